from django.http import HttpRequest

from accounts import selectors


def organizations(request: HttpRequest) -> dict[str, object]:
    """The signed-in person's organisations, for the switcher in the page header."""
    if not request.user.is_authenticated:
        return {}
    return {"my_organizations": selectors.organizations_visible_to(principal=request.user)
            .order_by("name")}
