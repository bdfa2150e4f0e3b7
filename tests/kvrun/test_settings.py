import os
import subprocess
import sys

from tests.helpers import ROOT

PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": "a-production-secret-" + "x" * 50,
    "KVRUN_KEY_PEPPER": "a-production-pepper-" + "y" * 30,
    "ALLOWED_HOSTS": "kvrun.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://kvrun.example.com",
    "KVRUN_BASE_URL": "https://kvrun.example.com",
}


def test_deploy_check_reports_nothing_in_production() -> None:
    result = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level",
                             "WARNING"], cwd=ROOT, env={**os.environ, **PRODUCTION},
                            capture_output=True, text=True)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_settings_refuse_to_start_without_a_secret_key() -> None:
    env = {k: v for k, v in {**os.environ, **PRODUCTION}.items() if k != "SECRET_KEY"}

    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env,
                            capture_output=True, text=True)

    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr
