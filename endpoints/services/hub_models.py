"""Models an organisation adds from a Hugging Face hub by id: inspected, judged and pinned
before anything downloads or any device is held (engine.hub reads the repository without its
weights)."""

import re
import secrets
from dataclasses import asdict

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from accounts.models import Organization, User
from accounts.services import require_manager
from endpoints.models import ModelSpec, Task
from endpoints.selectors import EnginesOnline, engines_online
from engine import hub, parsers, tasks
from engine.sizing import GB
from kvrun.common.sealing import seal

REPEATED = "one_model_per_organization_repository_commit"
# Between an organisation's slug and its model's name; catalog slugs never have it.
OWN_MODEL_SEPARATOR = "--"
# What an HTTP header can carry of a token: printable ASCII, no spaces.
TOKEN_SHAPE = re.compile(r"[!-~]+")


def do_add_model_from_hub(*, organization: Organization, actor_role: str | None,
                          added_by: User | None, repo_id: str, revision: str = "",
                          token: str = "", task: str | None = None,
                          tool_call_parser: str | None = None,
                          reasoning_parser: str | None = None) -> ModelSpec:
    """Add the hub repository `repo_id` at `revision` (a branch, tag or commit; the default
    branch when empty) as a model of `organization`, pinned to the commit it resolves to now.
    It serves `task` (None: what its config says, engine.tasks.detected; a generative
    checkpoint trained to embed, such as Qwen3-Embedding, is added with "embed"). A
    generating model's engines start with `tool_call_parser` and `reasoning_parser` ("":
    none; None: its family's where its tokenizer has the parser's markers, engine.parsers).

    Raises ValidationError keyed by `hf_repo`, `hf_revision` or `hf_token`, and changes
    nothing, when the repository cannot be read with the token given, has no safetensors
    weights, needs remote code an operator has not allowed, has an architecture no engine
    online runs, or is larger than every node's model cache; keyed by `task` for a task its
    architecture cannot serve, and by `tool_call_parser` or `reasoning_parser` for a parser
    no engine online offers or one asked of a model that does not generate. The token, when
    given, is kept sealed (kvrun.common.sealing) for the downloads; it is never returned.
    """
    require_manager(actor_role, "add models")
    repo_id, revision, token = repo_id.strip(), revision.strip(), token.strip()
    if token and not TOKEN_SHAPE.fullmatch(token):
        raise ValidationError({"hf_token": [
            "An access token is letters, digits and punctuation without spaces (hf_…); paste "
            "it again from the hub's settings."]})
    try:
        checkpoint = hub.inspect(endpoint=settings.KVRUN_HUB_URL, repo_id=repo_id,
                                 revision=revision or None, token=token or None)
        fields = checkpoint.describe()
    except hub.HubRefusal as exc:
        raise ValidationError({exc.field: [exc.message]}) from exc
    except KeyError as exc:
        raise ValidationError({"hf_repo": [
            f"{repo_id}'s config.json has no {exc.args[0]!r}: kvrun sizes decoder language "
            "models from their config, and this one does not say enough."]}) from exc
    online = engines_online(organization_id=organization.id)
    refusal = _refusal(checkpoint, revision=revision, online=online)
    if refusal:
        raise ValidationError({"hf_repo": [refusal]})
    fields["task"] = _task(asked=task, detected=fields["task"], checkpoint=checkpoint)
    fitting = (fields.pop("tool_call_parser"), fields.pop("reasoning_parser"))
    if fields["task"] in tasks.POOLING:
        if tool_call_parser or reasoning_parser:
            raise ValidationError({"tool_call_parser" if tool_call_parser else
                                   "reasoning_parser": [
                                       "Parsers read generated text; an embedding model or a "
                                       "reranker generates none. Leave them out."]})
        chosen = ("", "")
    else:
        chosen = _parsers(asked=(tool_call_parser, reasoning_parser), fitting=fitting,
                          online=online, checkpoint=checkpoint)
    files = [asdict(f) for f in hub.engine_files(checkpoint.files,
                                                 remote_code=checkpoint.remote_code)]
    model = ModelSpec(
        **fields, organization=organization, added_by=added_by, name=repo_id,
        hf_repo=repo_id, hf_revision=revision, hf_commit=checkpoint.commit, files=files,
        licence=checkpoint.licence, chat_template=checkpoint.chat_template,
        trust_remote_code=checkpoint.remote_code, tool_call_parser=chosen[0],
        reasoning_parser=chosen[1], hf_token_sealed=seal(token) if token else "",
        hf_token_last4=token[-4:])
    return _insert(model)


def remote_code_allowed(*, repo_id: str, revision: str, commit: str) -> bool:
    """Whether an operator allows this commit's own code to run on the nodes: listed in
    KVRUN_REMOTE_CODE_REPOS as `owner/name@<commit>`, or as `owner/name` and taken from its
    default branch. Never a pull request's or another branch's code by the repository's name
    alone: anyone can open a pull request on a hub repository."""
    allowed = settings.KVRUN_REMOTE_CODE_REPOS
    return f"{repo_id}@{commit}" in allowed or (
        repo_id in allowed and revision in ("", hub.DEFAULT_REVISION))


def _refusal(checkpoint: hub.HubCheckpoint, *, revision: str,
             online: EnginesOnline) -> str | None:
    repo = checkpoint.repo_id
    if checkpoint.remote_code and not remote_code_allowed(
            repo_id=repo, revision=revision, commit=checkpoint.commit):
        return (f"{repo} at {checkpoint.commit[:12]} needs code from its own repository to "
                "run (its config names custom classes), and kvrun runs such code only where "
                "an operator allows it: ask one to add it to KVRUN_REMOTE_CODE_REPOS "
                "(owner/name for its default branch, owner/name@<commit> for one commit).")
    if not online.architectures:
        return (f"No node online says which architectures its engines run, so {repo} "
                f"({checkpoint.architecture}) cannot be judged yet: add it once a node is "
                "online (docs/operations.md says how to add one).")
    if checkpoint.architecture not in online.architectures and not checkpoint.remote_code:
        built = ", ".join(sorted(online.versions)) or "unknown"
        return (f"{repo} is a {checkpoint.architecture}, which the engines online (vLLM "
                f"{built}) cannot run: pick a model of an architecture vLLM supports, or ask "
                "an operator for a node whose vLLM runs it.")
    if checkpoint.download_bytes > online.largest_cache:
        return (f"{repo}'s weights take {checkpoint.download_bytes / GB:.1f} GB, more than "
                f"any node's model cache holds (the largest: {online.largest_cache / GB:.1f} "
                "GB): ask an operator for a node with a larger cache (KVRUN_MODEL_CACHE_GIB).")
    return None


def _task(*, asked: str | None, detected: str, checkpoint: hub.HubCheckpoint) -> str:
    """The task asked for, where the checkpoint can serve it: what its config says, or
    embeddings from a generative checkpoint the engine converts (a `…ForCausalLM`)."""
    if detected == tasks.UNSERVED:
        raise ValidationError({"hf_repo": [
            f"{checkpoint.repo_id} is a {checkpoint.architecture} of several labels: kvrun "
            "serves generative models, embedding models and rerankers (classifiers of one "
            "label)."]})
    if asked is None or asked == detected:
        return detected
    if asked == Task.EMBED and tasks.converts_to_embed(checkpoint.architecture):
        return asked
    serves: dict[str, str] = {
        Task.GENERATE: "a generative model", Task.EMBED: "an embedding model (no head)",
        Task.SCORE: "a reranker (a classifier of one label)"}
    why = (f"only {serves[Task.SCORE]} scores" if asked == Task.SCORE
           else f"it serves {Task(detected).label}")
    raise ValidationError({"task": [
        f"{checkpoint.repo_id} is a {checkpoint.architecture}, {serves[detected]}: {why}. "
        f"Leave the task out to take what its config says ({Task(detected).label})."]})


def _parsers(*, asked: tuple[str | None, str | None], fitting: tuple[str, str],
             online: EnginesOnline, checkpoint: hub.HubCheckpoint) -> tuple[str, str]:
    """The (tool-call, reasoning) parsers: those asked for, else those that fit. Either must
    be offered by an engine online, and one asked for must find its markers in the
    tokenizer: an engine refuses to start otherwise."""
    chosen = []
    for field, kind, name, fits, offered in (
            ("tool_call_parser", "tool-call", asked[0], fitting[0], online.tool_parsers),
            ("reasoning_parser", "reasoning", asked[1], fitting[1], online.reasoning_parsers)):
        if name is None:
            chosen.append(fits if fits in offered else "")
            continue
        if name and name not in offered:
            listed = ", ".join(sorted(offered)) or "none yet"
            raise ValidationError({field: [
                f"No engine online offers the {kind} parser {name!r}; those they offer: "
                f"{listed}. Leave it out to take the model family's, or send \"\" for none."]})
        if missing := parsers.lacking(name, tokens=checkpoint.special_tokens):
            raise ValidationError({field: [
                f"{checkpoint.repo_id}'s tokenizer has no {', '.join(missing)}, which the "
                f"{kind} parser {name!r} reads: its engines would not start. Pick the parser "
                "its model card names, or send \"\" for none."]})
        chosen.append(name)
    return chosen[0], chosen[1]


def _insert(model: ModelSpec) -> ModelSpec:
    """Insert under the first free slug in the organisation's own namespace
    (`<organisation>--<repository name>`, which no catalog slug has), then with the commit,
    then with a random suffix: no organisation's choice can take or reveal another's, or a
    catalog model's. The same repository at the same commit twice in one organisation is
    refused, naming the model it already is."""
    assert model.organization is not None
    name = re.sub(r"[^a-z0-9]+", "-", model.hf_repo.split("/")[-1].lower()).strip("-")[:40]
    base = f"{model.organization.slug}{OWN_MODEL_SEPARATOR}{name or 'model'}"[:70]
    candidates = [base, f"{base}-{model.hf_commit[:7]}", f"{base}-{secrets.token_hex(3)}"]
    for slug in candidates:
        model.slug = slug
        try:
            with transaction.atomic():
                model.save(force_insert=True)
            return model
        except IntegrityError as exc:
            if REPEATED in str(exc):
                existing = ModelSpec.objects.get(organization=model.organization,
                                                 hf_repo=model.hf_repo,
                                                 hf_commit=model.hf_commit)
                raise ValidationError({"hf_repo": [
                    f"{model.hf_repo} at {model.hf_commit[:12]} is already this "
                    f"organisation's model {existing.slug!r}."]}) from exc
    raise ValidationError({"hf_repo": ["Could not name the model; try again."]})


def do_pin_model(*, model: ModelSpec, token: str | None) -> ModelSpec:
    """Pin a catalog model named by its hub id alone to the commit its revision (the default
    branch when none) resolves to now, with the files an engine reads; a model already pinned
    is returned as it is. The first node to download it pins it, and every later one fetches
    the same commit. Raises hub.HubRefusal."""
    if model.hf_commit:
        return model
    commit, files = hub.pin(endpoint=settings.KVRUN_HUB_URL, repo_id=model.hf_repo,
                            revision=model.hf_revision or None, token=token)
    wanted = hub.engine_files(files, remote_code=model.trust_remote_code)
    ModelSpec.objects.filter(id=model.id, hf_commit="").update(
        hf_commit=commit, files=[asdict(f) for f in wanted])
    return ModelSpec.objects.get(id=model.id)  # another node may have pinned it first


def do_promote_models(*, model_ids: list[int]) -> int:
    """Put organisations' own models in the public catalog (an operator's choice in the
    console); their tokens stay sealed and serve the downloads as before. Returns how many
    were promoted."""
    return ModelSpec.objects.filter(id__in=model_ids, organization__isnull=False).update(
        organization=None)
