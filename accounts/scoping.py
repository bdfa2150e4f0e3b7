"""The organisation in an API URL, for the REST views of every app."""

from functools import cached_property

from rest_framework.views import APIView

from accounts import selectors
from accounts.models import Organization


class OrganizationScoped(APIView):
    """Resolves the organisation in the URL (`org_slug`) and the caller's role in it; an
    organisation the caller cannot see is a 404. The first base of the app's REST views."""

    @cached_property
    def organization(self) -> Organization:
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request to scope by
            return Organization()
        return selectors.get_organization(principal=self.request.user, slug=self.kwargs["org_slug"])

    @cached_property
    def actor_role(self) -> str | None:
        return selectors.role_of(principal=self.request.user, organization=self.organization)
