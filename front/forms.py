from django import forms

from accounts.models import Role, Scope


class APIKeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    scope = forms.ChoiceField(choices=Scope.choices)
    expires_at = forms.DateTimeField(required=False, label="Expires at (UTC, optional)",
                                     widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))


class InviteForm(forms.Form):
    email = forms.EmailField(required=False, label="Email (optional)")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)
