"""The node agent's end of the node channel (fleet.api, /node/v1/): every call it makes to
the control plane, with its own credential and nothing else.

Pure Python (httpx): a node holds the control plane's URL and, once, a join token, which it
exchanges for a credential kept in a file only the agent's user can read. A call that cannot
reach the control plane, or that it answers with a 5xx or a 429, is tried again for up to
RETRY_FOR_SECONDS (a restart of the web process is survived); a refusal is raised at once.
"""

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx

from engine.build import EngineBuild

logger = logging.getLogger(__name__)

class State:
    """A replica's states, as the channel names them (endpoints.states)."""

    STARTING = "starting"
    DOWNLOADING = "downloading"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"


# A replica in one of these has its agent at work on it (fleet.replicas.AGENT_AT_WORK).
AT_WORK = frozenset({State.DOWNLOADING, State.LOADING, State.READY})

RETRY_FOR_SECONDS = 60.0
CALL_TIMEOUT_SECONDS = 30.0
HEARTBEAT_TIMEOUT_SECONDS = 10.0
_RETRIED_STATUSES = {429, 500, 502, 503, 504}


class NodeRevoked(Exception):
    """The control plane refuses this node's credential: an operator revoked it."""


class ChannelRefused(Exception):
    """The control plane refused a call (a 4xx other than 401): the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChannelDown(Exception):
    """The control plane did not answer within RETRY_FOR_SECONDS."""


class NodeChannel:
    """The calls of the agent of one node. Safe to share between threads (httpx.Client is)."""

    def __init__(self, *, url: str, credential_file: Path,
                 transport: httpx.BaseTransport | None = None,
                 retry_for: float = RETRY_FOR_SECONDS) -> None:
        self.credential_file = credential_file
        self.retry_for = retry_for
        self._client = httpx.Client(base_url=f"{url.rstrip('/')}/node/v1/",
                                    timeout=CALL_TIMEOUT_SECONDS, transport=transport)
        self._credential = (credential_file.read_text().strip()
                            if credential_file.is_file() else "")

    def join(self, *, name: str, join_token: str, report: dict[str, Any]) -> dict[str, Any]:
        """Register the node `name` with what its agent detected (`report`): with its
        credential when it holds one, else by exchanging `join_token` (made for that name)
        for one, which is written to credential_file (0600) before anything else. Returns
        the node as the control plane sees it ("node") and the control plane's timings
        ("timings", nodes.config.Timings).
        Raises NodeRevoked, ChannelRefused (a bad join token), ChannelDown."""
        if self._credential:
            try:
                return self._call("POST", "register", json=report).json()
            except NodeRevoked:
                if not join_token:
                    raise
                # Given a join token all the same: an operator let the node in anew.
                self._credential = ""
        if not join_token:
            raise ChannelRefused(401, "this node holds no credential and was given no join "
                                      "token: ask an operator for one (KVRUN_JOIN_TOKEN)")
        answer = self._call("POST", "enrol", authenticated=False, json={
            "join_token": join_token, "name": name, **report}).json()
        self._keep(answer.pop("credential"))
        return answer

    def _keep(self, credential: str) -> None:
        """Write the credential where the next start finds it: readable by this user alone,
        whole or not at all (the join token is spent)."""
        self.credential_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = self.credential_file.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        written = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(written, "w") as file:
            file.write(credential)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, self.credential_file)
        self._credential = credential

    # The node's own reports.

    def record_build(self, build: EngineBuild) -> None:
        self._call("POST", "build", json={
            "version": build.version, "architectures": sorted(build.architectures),
            "tool_parsers": sorted(build.tool_parsers),
            "reasoning_parsers": sorted(build.reasoning_parsers)})

    def heartbeat(self, *, engines: Iterable[str]) -> set[str] | None:
        """The engines that run here; returns the replicas whose engines must stop, or None
        when the node must register again. An operator's request to rotate the credential,
        which the answer carries, is done here."""
        try:  # not retried, nor waited for long: the next heartbeat comes in seconds
            answer = self._call("POST", "heartbeat", json={"engines": sorted(engines)},
                                patience=0.0, timeout=HEARTBEAT_TIMEOUT_SECONDS).json()
        except ChannelRefused as exc:
            if exc.status == 409:
                return None
            raise
        if answer.get("rotate"):
            self.rotate()
        return set(answer["stop"])

    def rotate(self) -> None:
        """Take a new credential and keep it in place of the one in use, which the control
        plane refuses from the new one's first use. A refusal (too many waiting unused) is
        logged: the next heartbeat asks again."""
        try:
            fresh = self._call("POST", "credential", patience=0.0).json()["credential"]
        except ChannelRefused as exc:
            logger.warning("node channel: the credential was not rotated: %s", exc)
            return
        self._keep(fresh)
        logger.info("node channel: credential rotated")

    def record_model_cache(self, *, entries: list[dict[str, Any]]) -> None:
        self._call("POST", "model-cache", json={"entries": entries})

    def record_samples(self, *, samples: list[dict[str, Any]]) -> int:
        if not samples:
            return 0
        return self._call("POST", "samples", json={"samples": samples}).json()["kept"]

    def work(self, *, seen: str, wait: float) -> dict[str, Any]:
        """The node's work (fleet.feed): at once when it differs from version `seen`, else
        once it changes or `wait` seconds have passed. Not retried: the caller polls again."""
        return self._call("GET", f"work?seen={seen}&wait={wait:g}", patience=0.0,
                          timeout=wait + CALL_TIMEOUT_SECONDS).json()

    def replicas(self) -> list[dict[str, Any]]:
        """The node's replicas that have, or may have, an engine here."""
        return self._call("GET", "replicas").json()["replicas"]

    # One replica of the node's: a 404 (no longer the node's) is None or False.

    def replica(self, replica_id: UUID | str) -> dict[str, Any] | None:
        """What starting the replica's engine needs (fleet.selectors.replica_spec)."""
        return self._replica_call("GET", replica_id, "", default=None)

    def move(self, replica_id: UUID | str, *, from_states: Iterable[str], to_state: str,
             message: str, **fields: Any) -> bool:
        answer = self._replica_call("POST", replica_id, "/move", default=None, json={
            "from_states": sorted(from_states), "to_state": to_state, "message": message,
            **fields})
        return bool(answer and answer["moved"])

    def fail(self, replica_id: UUID | str, *, from_states: Iterable[str], reason: str,
             log_tail: str) -> bool:
        answer = self._replica_call("POST", replica_id, "/failure", default=None, json={
            "from_states": sorted(from_states), "reason": reason[:2000], "log_tail": log_tail})
        return bool(answer and answer["moved"])

    def progress(self, replica_id: UUID | str, *, state: str, stage: str, percent: int,
                 download_done_at: str | None = None) -> bool:
        """Show how far the replica's step is (while it downloads, how far the download is);
        False once the step is no longer wanted."""
        answer = self._replica_call("POST", replica_id, "/progress", default=None, json={
            "state": state, "stage": stage[:80], "percent": percent,
            "download_done_at": download_done_at})
        return bool(answer and answer["current"])

    def certificate(self, replica_id: UUID | str, *, signing_request: str
                    ) -> dict[str, str] | None:
        """The certificate for the replica's engine (fleet.certificates), for the key of
        `signing_request`: the certificate, the authority's and the name it carries. None
        when the replica is no longer being started here (a 404, or a 403: stopped)."""
        try:
            return self._replica_call("POST", replica_id, "/certificate", default=None,
                                      json={"signing_request": signing_request})
        except ChannelRefused as exc:
            if exc.status == 403:
                return None
            raise

    def record_pid(self, replica_id: UUID | str, *, pid: int) -> None:
        self._replica_call("POST", replica_id, "/pid", default=None, json={"pid": pid})

    def record_log(self, replica_id: UUID | str, *, log_tail: str) -> None:
        self._replica_call("POST", replica_id, "/log", default=None,
                           json={"log_tail": log_tail})

    def note(self, replica_id: UUID | str, *, message: str) -> None:
        """An event for the replica's user; dropped when the agent is no longer at work on
        it (a 403)."""
        try:
            self._replica_call("POST", replica_id, "/events", default=None,
                               json={"message": message[:500]})
        except ChannelRefused as exc:
            if exc.status != 403:
                raise

    def adapters(self, replica_id: UUID | str) -> list[dict[str, Any]]:
        answer = self._replica_call("GET", replica_id, "/adapters", default=None)
        return answer["adapters"] if answer else []

    def record_served_adapters(self, replica_id: UUID | str, *, names: list[str]) -> None:
        self._replica_call("POST", replica_id, "/adapters", default=None,
                           json={"names": names})

    def adapter_file(self, replica_id: UUID | str, *, adapter_id: int, path: str) -> bytes:
        """A file of an uploaded adapter. Raises ChannelRefused when there is none (now)."""
        return self._call("GET", f"replicas/{replica_id}/adapters/{adapter_id}/files/{path}"
                          ).content

    def hub_token(self, replica_id: UUID | str, *, adapter_id: int | None = None
                  ) -> str | None:
        """The hub token the replica's download (of its model, or of one adapter) needs,
        for that download only. Raises ChannelRefused when it may not have it now."""
        body = {} if adapter_id is None else {"adapter": adapter_id}
        return self._call("POST", f"replicas/{replica_id}/hub-token", json=body).json()["token"]

    def pin(self, replica_id: UUID | str) -> dict[str, Any]:
        """Pin the replica's model to a commit; returns the model as pinned. Raises
        ChannelRefused (a 502: the hub's refusal, in its words)."""
        return self._call("POST", f"replicas/{replica_id}/pin", refusals={502}).json()

    def pull(self, model_id: int) -> dict[str, Any] | None:
        """What an operator's pre-pull of a model onto this node needs: the model, pinned,
        and its hub token; None when no such pull was asked of this node (or it was taken)."""
        try:
            return self._call("POST", f"pulls/{model_id}", refusals={502}).json()
        except ChannelRefused as exc:
            if exc.status == 404:
                return None
            raise

    # The transport.

    def _replica_call(self, method: str, replica_id: UUID | str, suffix: str, *,
                      default: Any, json: Any = None) -> Any:
        try:
            answer = self._call(method, f"replicas/{replica_id}{suffix}", json=json)
        except ChannelRefused as exc:
            if exc.status == 404:  # moved to another node, or gone
                return default
            raise
        return answer.json() if answer.content else default

    def _call(self, method: str, path: str, *, json: Any = None, authenticated: bool = True,
              refusals: set[int] | frozenset[int] = frozenset(),
              patience: float | None = None,
              timeout: float = CALL_TIMEOUT_SECONDS) -> httpx.Response:
        """The control plane's answer, tried again for `patience` seconds (retry_for unless
        given). Statuses in `refusals` are refused at once even where they are otherwise
        tried again (the hub's refusal, passed on as a 502)."""
        deadline = time.monotonic() + (self.retry_for if patience is None else patience)
        pause = 0.2
        while True:
            used = self._credential
            headers = {"Authorization": f"Bearer {used}"} if authenticated else {}
            try:
                response = self._client.request(method, path, json=json, headers=headers,
                                                timeout=timeout)
            except httpx.TransportError as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 401 and authenticated:
                    if used != self._credential:  # rotated meanwhile: the new one, at once
                        continue
                    raise NodeRevoked(_message(response))
                if response.status_code not in _RETRIED_STATUSES - refusals:
                    raise ChannelRefused(response.status_code, _message(response))
                why = f"status {response.status_code}"
            if time.monotonic() + pause > deadline:
                raise ChannelDown(f"the control plane did not answer {method} {path}: {why}")
            logger.info("node channel: %s %s failed (%s); trying again", method, path, why)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _message(response: httpx.Response) -> str:
    """The control plane's sentence for a refusal."""
    try:
        body = response.json()
    except ValueError:
        return f"status {response.status_code}"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("detail"):
            return str(body["detail"])
    return f"status {response.status_code}: {str(body)[:200]}"
