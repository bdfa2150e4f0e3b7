"""What every page with a form shares."""

from django import forms
from django.core.exceptions import ValidationError


def add_service_errors(form: forms.Form, error: ValidationError) -> None:
    """A service's ValidationError shown next to the fields it names (else above the form)."""
    by_field = error.message_dict if hasattr(error, "error_dict") else {None: error.messages}
    for field, messages in by_field.items():
        for message in messages:
            form.add_error(field if field in form.fields else None, message)
