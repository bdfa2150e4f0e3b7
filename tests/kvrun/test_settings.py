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


def test_the_debug_page_shows_no_setting_that_holds_the_redis_password() -> None:
    from django.conf import settings
    from django.views.debug import get_default_exception_reporter_filter

    shown = get_default_exception_reporter_filter().get_safe_settings()

    password = settings.REDIS_URL.split("@")[0]
    assert password and password not in str(shown)
    assert shown["REDIS_URL"] == shown["CELERY_BROKER_URL"] == "********************"


def test_the_debug_page_shows_no_token_a_request_or_a_frame_held() -> None:
    import sys

    from django.test import RequestFactory
    from django.views.debug import ExceptionReporter

    secret = "hf_" + "never_shown_" + str(6 * 7)  # made here: the page quotes the source
    request = RequestFactory().post("/orgs/acme/endpoints/new/model/",
                                    {"hf_repo": "acme/llama", "hf_token": secret})

    def add(token: str) -> None:
        raise RuntimeError("the hub broke")

    try:
        add(secret)
    except RuntimeError:
        page = ExceptionReporter(request, *sys.exc_info()).get_traceback_html()

    assert secret not in page
    assert "acme/llama" in page  # what is not secret still helps
