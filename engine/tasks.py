"""What an endpoint's engines do with a request: generate text, or pool a model's hidden
states into an embedding or a relevance score. Pure Python, no Django.

vLLM runs the last two with its pooling runner, which serves /v1/embeddings, /v1/score and
/v1/rerank and no generation at all. A checkpoint made for pooling says so by its
architecture (`BertModel`, `XLMRobertaForSequenceClassification`); a generative one (such as
Qwen3-Embedding's `Qwen3ForCausalLM`) is converted by the engine to embed (`--convert
embed`). Scoring needs a classifier's head: rerankers built on a generative model each need
overrides of their own, which kvrun does not set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GENERATE = "generate"
EMBED = "embed"
SCORE = "score"  # a cross-encoder: one relevance score for a query and a document
UNSERVED = ""  # a classifier of several labels: kvrun serves none of its tasks
POOLING = frozenset({EMBED, SCORE})
# The gateway's operations (gateway.protocol.OPERATIONS) each task's engines serve. An
# embedding model scores too: vLLM ranks by the cosine similarity of the two embeddings.
OPERATIONS = {
    GENERATE: frozenset({"chat.completions", "completions", "messages", "count_tokens"}),
    EMBED: frozenset({"embeddings", "score", "rerank"}),
    SCORE: frozenset({"score", "rerank"}),
}
ALL_OPERATIONS = frozenset().union(*OPERATIONS.values())


# Encoders' architectures: their attention reads the whole input at once and keeps no KV
# cache, which vLLM allocates for decoders alone.
ENCODERS = ("Bert", "Roberta", "XLMRoberta", "DistilBert", "ModernBert", "NomicBert",
            "Electra", "Deberta")


def keeps_kv_cache(architecture: str) -> bool:
    return not architecture.startswith(ENCODERS)


def detected(config: Mapping[str, Any]) -> str:
    """The task a checkpoint's config.json was made for: a sequence classifier with one
    label scores, one with several serves nothing kvrun offers (UNSERVED); a model without
    a head (`…Model`, `…EmbeddingModel`: an encoder's, or a decoder's hidden states) embeds;
    anything else generates (a person may still choose to embed with a `…ForCausalLM`)."""
    architecture = str((config.get("architectures") or [""])[0])
    if architecture.endswith("ForSequenceClassification"):
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        return SCORE if labels == 1 else UNSERVED
    if architecture.endswith("Model"):
        return EMBED
    return GENERATE


def converts_to_embed(architecture: str) -> bool:
    """Whether an engine can embed with a generative checkpoint (`--convert embed`)."""
    return architecture.endswith("ForCausalLM")


def runner_args(task: str, *, architecture: str) -> list[str]:
    """The engine's flags for `task`: none to generate; the pooling runner otherwise, and the
    head to convert a generative checkpoint to."""
    if task not in POOLING:
        return []
    argv = ["--runner", "pooling"]
    if task == EMBED and converts_to_embed(architecture):
        argv += ["--convert", "embed"]
    return argv
