// The playground: send the conversation, show the answer token by token, and per answer its
// time to first token, generation speed and token counts (from the stream's usage chunk).
(() => {
  const root = document.getElementById("playground");
  if (!root) return;
  const form = document.getElementById("chat-form");
  const transcript = document.getElementById("transcript");
  const error = document.getElementById("chat-error");
  const send = document.getElementById("chat-send");
  const history = [];

  function bubble(role, text) {
    const item = document.createElement("li");
    item.className = `message ${role}`;
    const body = document.createElement("div");
    body.className = "content";
    body.textContent = text;
    item.append(body);
    transcript.append(item);
    return item;
  }

  function fail(message) {
    error.textContent = message;
    error.hidden = false;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    const text = form.message.value.trim();
    if (!text) return fail("Write a message first.");
    const system = form.system.value.trim();
    history.push({ role: "user", content: text });
    const question = bubble("user", text);
    form.message.value = "";
    const answer = bubble("assistant", "");
    answer.classList.add("streaming");
    const content = answer.querySelector(".content");
    send.disabled = true;
    const started = performance.now();
    let firstToken = null;
    let usage = null;
    try {
      const response = await fetch(root.dataset.url, {
        method: "POST",
        headers: { "Content-Type": "application/json",
                   "X-CSRFToken": form.csrfmiddlewaretoken.value },
        body: JSON.stringify({
          messages: (system ? [{ role: "system", content: system }] : []).concat(history),
          max_tokens: Number(form.max_tokens.value), temperature: Number(form.temperature.value),
          adapter: form.adapter ? form.adapter.value : "",
        }),
      });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        throw new Error(body.error?.message || `The request failed (${response.status}).`);
      }
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        const events = buffer.split("\n\n");
        buffer = events.pop();
        for (const event of events) {
          const data = event.replace(/^data: /, "").trim();
          if (!data || data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices?.[0]?.delta?.content;
          if (delta) {
            firstToken ??= performance.now();
            content.textContent += delta;
          }
          if (chunk.usage) usage = chunk.usage;
        }
      }
      history.push({ role: "assistant", content: content.textContent });
      const stats = document.createElement("p");
      stats.className = "stats muted";
      const ttft = firstToken === null ? null : firstToken - started;
      const seconds = (performance.now() - (firstToken ?? started)) / 1000;
      const rate = usage && seconds > 0 ? usage.completion_tokens / seconds : null;
      stats.textContent = [
        ttft === null ? "no tokens" : `TTFT ${Math.round(ttft)} ms`,
        rate === null ? null : `${rate.toFixed(1)} tokens/s`,
        usage ? `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens` : null,
      ].filter(Boolean).join(" · ");
      answer.append(stats);
    } catch (err) {
      // What failed leaves the conversation, on screen as in what the next message sends.
      history.pop();
      question.remove();
      answer.remove();
      form.message.value = text;
      fail(err.message);
    } finally {
      answer.classList.remove("streaming");
      send.disabled = false;
      form.message.focus();
    }
  });

  document.getElementById("chat-clear").addEventListener("click", () => {
    history.length = 0;
    transcript.replaceChildren();
  });
  send.disabled = false;
})();

// An embedding model's playground compares two texts (dimensions, cosine similarity); a
// reranker's orders documents by relevance, with their scores.
(() => {
  const root = document.getElementById("pooled");
  if (!root) return;
  const form = document.getElementById("pooled-form");
  const result = document.getElementById("pooled-result");
  const error = document.getElementById("pooled-error");
  const send = document.getElementById("pooled-send");

  function fact(term, value) {
    const item = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = value;
    item.append(dt, dd);
    return item;
  }

  function cosine(a, b) {
    let dot = 0, left = 0, right = 0;
    a.forEach((value, i) => { dot += value * b[i]; left += value * value; right += b[i] * b[i]; });
    return dot / Math.sqrt(left * right);
  }

  function showEmbeddings(answer) {
    const [first, second] = answer.data.map((item) => item.embedding);
    const facts = document.createElement("dl");
    facts.className = "facts";
    facts.dataset.testid = "embedding-facts";
    facts.append(fact("Dimensions", first.length.toLocaleString()),
                 fact("Cosine similarity", cosine(first, second).toFixed(4)),
                 fact("Prompt tokens", answer.usage.prompt_tokens.toLocaleString()));
    const head = document.createElement("p");
    head.className = "muted small";
    head.textContent = `First text's embedding begins ${first.slice(0, 6).map((v) => v.toFixed(4)).join(", ")}, …`;
    result.replaceChildren(facts, head);
  }

  function showRanking(answer) {
    const table = document.createElement("table");
    table.dataset.testid = "ranking";
    const header = table.createTHead().insertRow();
    for (const title of ["Rank", "Score", "Document"]) {
      const cell = document.createElement("th");
      cell.textContent = title;
      header.append(cell);
    }
    const body = table.createTBody();
    answer.results.forEach((item, rank) => {
      const row = body.insertRow();
      row.insertCell().textContent = String(rank + 1);
      row.insertCell().textContent = item.relevance_score.toFixed(4);
      row.insertCell().textContent = item.document.text;
    });
    const tokens = document.createElement("p");
    tokens.className = "muted small";
    tokens.textContent = `${answer.usage.prompt_tokens.toLocaleString()} prompt tokens: the query is read again with each document.`;
    result.replaceChildren(table, tokens);
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    const embed = root.dataset.task === "embed";
    const asked = embed
      ? { texts: [form.first.value, form.second.value] }
      : { query: form.query.value,
          documents: form.documents.value.split("\n").map((line) => line.trim()).filter(Boolean) };
    send.disabled = true;
    try {
      const response = await fetch(root.dataset.url, {
        method: "POST",
        headers: { "Content-Type": "application/json",
                   "X-CSRFToken": form.csrfmiddlewaretoken.value },
        body: JSON.stringify(asked),
      });
      const answer = await response.json().catch(() => ({}));
      if (!response.ok) throw new Error(answer.error?.message || `The request failed (${response.status}).`);
      if (embed) showEmbeddings(answer); else showRanking(answer);
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    } finally {
      send.disabled = false;
    }
  });
  send.disabled = false;
})();
