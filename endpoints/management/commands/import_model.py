from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from endpoints.services import do_import_model


class Command(BaseCommand):
    help = ("Add or update a catalog model from a local Hugging Face folder "
            "(config.json, *.safetensors).")

    def add_arguments(self, parser: object) -> None:
        parser.add_argument("directory", type=Path)
        parser.add_argument("--slug", help="Catalog slug (default: the folder name).")
        parser.add_argument("--licence", default="unknown")

    def handle(self, *args: object, directory: Path, slug: str | None, licence: str,
               **options: object) -> None:
        try:
            model, created = do_import_model(directory=directory, slug=slug, licence=licence)
        except (OSError, ValueError, KeyError) as exc:
            raise CommandError(f"cannot import {directory}: {exc}") from exc
        verb = "added" if created else "updated"
        self.stdout.write(f"{verb} {model.slug}: {model.parameters:,} parameters, "
                          f"{model.layers} layers, {model.kv_heads} KV heads of {model.head_dim}, "
                          f"context {model.max_context:,}")
