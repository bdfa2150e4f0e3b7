from django import forms


class SignUpForm(forms.Form):
    email = forms.CharField(max_length=254, widget=forms.EmailInput(attrs={"autofocus": True}))
    password = forms.CharField(max_length=128, strip=False, widget=forms.PasswordInput)
    organization_name = forms.CharField(max_length=100, required=False,
                                        label="Organisation name (optional)")
