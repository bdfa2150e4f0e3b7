"""The catalogs of models and GPU types: loaded from endpoints/catalog/*.json, and models
imported from a local checkpoint."""

import json
from pathlib import Path
from typing import TypeVar

from django.db import transaction

from endpoints.models import GPUType, ModelSpec
from engine import hf_checkpoint, tasks

CATALOG_DIR = Path(__file__).resolve().parent.parent / "catalog"


def do_load_catalogs(*, directory: Path = CATALOG_DIR) -> tuple[int, int]:
    """Insert or update every model and GPU type from the catalog files, keyed by slug.

    Returns (models, gpu types) loaded. Rows not in the files are left alone, so an
    operator's additions survive a reload. A GPU type's price is the catalog's only when it
    is first loaded: from then on prices change by version (billing.models.GPUPrice), which
    bill and, once in effect, quote (billing.rollup.do_quote_prices_in_effect).
    """
    models = json.loads((directory / "models.json").read_text())
    gpus = json.loads((directory / "gpus.json").read_text())
    with transaction.atomic():
        _upsert(ModelSpec, models)
        _upsert(GPUType, gpus, kept=("hourly_price_usd",))
    return len(models), len(gpus)


Catalog = TypeVar("Catalog", ModelSpec, GPUType)


def _upsert(model: type[Catalog], rows: list[dict], kept: tuple[str, ...] = ()) -> None:
    fields = [name for name in rows[0] if name not in ("slug", *kept)]
    model.objects.bulk_create(
        [model(**row) for row in rows], update_conflicts=True, unique_fields=["slug"],
        update_fields=fields,
    )


def do_import_model(*, directory: Path, slug: str | None = None,
                    licence: str = "unknown") -> tuple[ModelSpec, bool]:
    """Add or update a catalog model from a local checkpoint folder. Returns (model, created).
    Raises ValueError for a slug in an organisation's namespace (with `--`), and for a
    classifier of several labels, which kvrun does not serve."""
    fields = hf_checkpoint.describe(directory)
    if fields["task"] == tasks.UNSERVED:
        raise ValueError(f"{fields['architecture']} of several labels: kvrun serves "
                         "generative models, embedding models and rerankers")
    fields["slug"] = slug or fields["slug"]
    if "--" in fields["slug"]:
        raise ValueError(f"{fields['slug']!r}: a catalog slug has no '--', which names "
                         "organisations' own models")
    fields.update(hf_repo=str(Path(directory).resolve()), licence=licence)
    return ModelSpec.objects.update_or_create(slug=fields.pop("slug"), defaults=fields)
