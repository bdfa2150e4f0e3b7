from django.core.management.base import BaseCommand

from endpoints.services import do_load_catalogs


class Command(BaseCommand):
    help = "Load or refresh the model and GPU catalogs from endpoints/catalog/."

    def handle(self, *args: object, **options: object) -> None:
        models, gpus = do_load_catalogs()
        self.stdout.write(f"catalogs: {models} models, {gpus} GPU types")
