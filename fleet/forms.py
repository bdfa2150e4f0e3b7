"""What every form that makes a join token asks (the console's and the dashboard's)."""

from typing import Any

from django import forms

from fleet.enrolment import NODE_NAME, ZONE_NAME


def as_sentence(refusal: object) -> str:
    """A service's refusal (fleet.enrolment's are clauses, as its commands print them) as a
    sentence beside a form's field."""
    text = str(refusal)
    return f"{text[:1].upper()}{text[1:]}."


class NodeTokenFields(forms.Form):
    """The node's name and zone; the zone needs a region, which each form asks its way."""

    node_name = forms.RegexField(
        regex=rf"\A{NODE_NAME.pattern}\Z", max_length=100, label="Node name",
        help_text="The host's name: letters, digits, '.', '_' or '-'.",
        error_messages={"invalid": "Use up to 100 letters, digits, '.', '_' or '-', starting "
                                   "with a letter or digit."})
    zone = forms.RegexField(regex=rf"\A{ZONE_NAME.pattern}\Z", max_length=40, required=False,
                            help_text="Its zone within the region, if any.")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if cleaned.get("zone") and not cleaned.get("region"):
            self.add_error("zone", "A zone is within a region: choose the region too.")
        return cleaned
