import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_the_models_and_their_migrations_agree() -> None:
    # Exits with status 1 (SystemExit) when a model change has no migration.
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)
