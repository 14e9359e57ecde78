"""What the API modules (``_messages.py``, ``_responses_api.py``) need of the app serving them:
its settings and shared objects, and the steps of a generation request before it is routed.
``FrontendApp`` is one (structurally); the modules never import it, which imports them."""

from __future__ import annotations

from typing import Protocol

from ..llm import Migration, PreprocessedRequest, RouteOptions
from ._asgi import Scope
from ._images import MediaPolicy
from ._limits import HttpLimits, Offload
from ._responses_store import ResponsesStore
from ._scope import InFlight
from ._tenants import Ticket
from .errors import HttpError
from .metrics import FrontendMetrics
from .models import ModelEntry, ModelManager

__all__ = ["ApiHost"]


class ApiHost(Protocol):
    """The app an API module serves its requests for."""

    @property
    def manager(self) -> ModelManager | None: ...

    @property
    def metrics(self) -> FrontendMetrics: ...

    @property
    def limits(self) -> HttpLimits: ...

    @property
    def media(self) -> MediaPolicy: ...

    @property
    def responses(self) -> ResponsesStore: ...

    @property
    def in_flight(self) -> InFlight: ...

    @property
    def offload(self) -> Offload: ...

    @property
    def timeout(self) -> float | None: ...

    @property
    def idle_timeout(self) -> float | None: ...

    def admit(self, scope: Scope) -> Ticket | None:
        """The request's tenant ticket (None: no tenant limits)."""

    def target(self, scope: Scope) -> int | None:
        """The instance a ``direct``-mode request names."""

    def entry(self, model: str) -> tuple[ModelEntry, frozenset[int] | None]:
        """The model's entry, and the only instances its request may go to (None: any)."""

    def refuse_request(self, endpoint: str, exc: HttpError, ticket: Ticket | None) -> None:
        """Count a request refused before it reached a worker."""

    def migration(
        self, entry: ModelEntry, pre: PreprocessedRequest, options: RouteOptions
    ) -> Migration | None:
        """The request's migration if its worker is lost mid-stream (None: off)."""
