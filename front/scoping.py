"""Which organisation a dashboard page is about, and the signed-in person's role in it.

Another organisation's URL is a 404, never a 403: it must not tell anyone that it exists.
"""

from dataclasses import dataclass

from django.http import Http404, HttpRequest

from accounts import selectors
from accounts.models import MANAGER_ROLES, Organization
from endpoints.models import Endpoint
from endpoints.selectors import endpoints_of

CURRENT_ORGANIZATION = "organization"


@dataclass(frozen=True)
class Member:
    """The signed-in person in the page's organisation, with their role there."""

    organization: Organization
    role: str

    @property
    def manages(self) -> bool:
        return self.role in MANAGER_ROLES


def membership(request: HttpRequest, slug: str) -> Member:
    """The organisation `slug` as the signed-in person sees it; 404 when not a member.
    Remembered as the one `/` opens next time."""
    organization = selectors.get_organization(principal=request.user, slug=slug)
    if request.session.get(CURRENT_ORGANIZATION) != organization.slug:
        request.session[CURRENT_ORGANIZATION] = organization.slug
    return Member(organization=organization,
                      role=selectors.role_of(principal=request.user, organization=organization))


def current_organization(request: HttpRequest) -> Organization | None:
    """The organisation opened last, else the first by name; None for someone in none."""
    organizations = selectors.organizations_visible_to(principal=request.user).order_by("name")
    remembered = request.session.get(CURRENT_ORGANIZATION)
    return (remembered and organizations.filter(slug=remembered).first()) or organizations.first()


def endpoint_of(member: Member, name: str) -> Endpoint:
    endpoint = endpoints_of(organization=member.organization).filter(name=name).first()
    if endpoint is None:
        raise Http404("No such endpoint")
    return endpoint
