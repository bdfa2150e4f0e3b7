// Small behaviours shared by the dashboard's pages; everything works without them except
// copying to the clipboard, whose buttons stay disabled until this script handles them.
document.querySelectorAll("[data-copy]").forEach((button) => { button.disabled = false; });
document.addEventListener("click", async (event) => {
  const copy = event.target.closest("[data-copy]");
  if (copy) {
    const text = document.querySelector(copy.dataset.copy).textContent;
    await navigator.clipboard.writeText(text);
    copy.textContent = "Copied";
    setTimeout(() => { copy.textContent = "Copy"; }, 2000);
    return;
  }
  // Wizard choices: set a field (or pick a model) and let the live sizing follow.
  const setter = event.target.closest("[data-set]");
  if (setter) {
    const field = document.querySelector(`[name="${setter.dataset.set}"]`);
    field.value = setter.dataset.value;
    field.dispatchEvent(new Event("change", { bubbles: true }));
    field.focus();
    return;
  }
  const pick = event.target.closest("[data-pick-model]");
  if (pick) {
    const radio = document.querySelector(`input[name="model"][value="${pick.dataset.pickModel}"]`);
    if (radio) {
      radio.checked = true;
      radio.dispatchEvent(new Event("change", { bubbles: true }));
      radio.focus();
    } else {
      window.location.search = `?model=${encodeURIComponent(pick.dataset.pickModel)}`;
    }
  }
});

document.addEventListener("submit", (event) => {
  const message = event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});

// An endpoint name from a model's slug, as front.views.wizard.suggested_name makes it.
function suggestedName(slug) {
  return slug.toLowerCase().replace(/[^a-z0-9-]+/g, "-").slice(0, 40).replace(/^-+|-+$/g, "");
}

// Selecting a model highlights its card and, while the name is untouched, suggests one.
document.addEventListener("change", (event) => {
  if (event.target.name !== "model") return;
  document.querySelectorAll(".model-card").forEach((card) => {
    card.classList.toggle("selected", card.contains(event.target));
  });
  const name = document.querySelector('[name="name"]');
  if (name && (!name.value || name.dataset.suggested === name.value)) {
    name.value = suggestedName(event.target.value);
    name.dataset.suggested = name.value;
  }
});

// The wizard's catalog filters: hide the cards that do not match; the chosen one stays. The
// events stop here, so typing in a filter does not ask for a new sizing.
const filters = document.getElementById("catalog-filters");
if (filters) {
  const filter = (event) => {
    event.stopPropagation();
    const query = filters.querySelector('[name="q"]').value.trim().toLowerCase();
    const size = filters.querySelector('[name="size"]').value;
    const licence = filters.querySelector('[name="licence"]').value;
    const task = filters.querySelector('[name="task"]').value;
    const context = Number(filters.querySelector('[name="min_context"]').value || 0);
    let shown = 0;
    document.querySelectorAll(".model-card").forEach((card) => {
      const match = query.split(/\s+/).every((word) => card.dataset.search.includes(word))
        && (!size || card.dataset.size === size) && (!licence || card.dataset.licence === licence)
        && (!task || card.dataset.task === task)
        && Number(card.dataset.context) >= context;
      const keep = match || card.querySelector("input").checked;
      card.hidden = !keep;
      shown += keep;
    });
    document.getElementById("catalog-empty").hidden = shown > 0;
  };
  filters.addEventListener("input", filter);
  filters.addEventListener("change", (event) => event.stopPropagation());
}

// An embedding model or a reranker reads inputs in batches and generates nothing: the
// wizard asks for its longest input and the inputs read at once, and hides (and does not
// send) what only generation uses: LoRA adapters.
const POOLING_FIELDS = {
  context_length: ["Longest input (tokens)", "The longest text (a query and a document, for a reranker) one input may hold."],
  concurrency: ["Inputs per batch", "Texts read at once at that length: a batch holds this many inputs of the longest."],
};
const generating = {};
function askFor(task) {
  const pooling = task && task !== "generate";
  for (const [name, [label, help]] of Object.entries(POOLING_FIELDS)) {
    const labelled = document.querySelector(`#wizard label[for="id_${name}"]`);
    const helped = document.getElementById(`id_${name}_helptext`);
    if (!labelled) continue;
    generating[name] ??= [labelled.textContent, helped?.textContent];
    labelled.textContent = pooling ? label : generating[name][0];
    if (helped) helped.textContent = pooling ? help : generating[name][1];
  }
  document.querySelectorAll("#wizard [data-generate-only]").forEach((part) => {
    part.hidden = pooling;
    part.querySelectorAll("input, select").forEach((field) => { field.disabled = pooling; });
  });
}
askFor(document.querySelector('#wizard input[name="model"]:checked')
  ?.closest(".model-card").dataset.task);

// Choosing a model brings the context within its maximum. This listens on the catalog,
// below the form, so the live sizing that the form asks for next already sees the new value.
document.getElementById("catalog")?.addEventListener("change", (event) => {
  if (event.target.name !== "model") return;
  const card = event.target.closest(".model-card");
  const most = Number(card.dataset.context);
  const context = document.querySelector('#wizard [name="context_length"]');
  if (context && Number(context.value) > most) context.value = most;
  askFor(card.dataset.task);
});

// A name the page suggested for the chosen model may be replaced when another is chosen.
const chosen = document.querySelector('input[name="model"]:checked');
const nameField = document.querySelector('#wizard [name="name"]');
if (chosen && nameField && nameField.value === suggestedName(chosen.value)) {
  nameField.dataset.suggested = nameField.value;
}
