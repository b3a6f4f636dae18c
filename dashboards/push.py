"""Upload dashboards to a Grafana over its HTTP API (grafana-client): into one folder, created
if missing, overwriting earlier versions. Failures become OSError (Grafana unreachable) or
ValueError (a refusal) with what to do; the token never appears in a message."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast
from urllib.parse import urljoin, urlsplit, urlunsplit

from grafana_client.api import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaTimeoutError

from dashboards.model import JSON

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0


def push(
    dashboards: Iterable[JSON], url: str, token: str, folder: str, timeout: float = TIMEOUT_S
) -> list[tuple[str, str]]:
    """Upload `dashboards` into `folder`; returns (uid, dashboard URL) for each."""
    public = public_url(url)
    api = GrafanaApi.from_url(public, credential=token, timeout=timeout)
    try:
        folder_uid = ensure_folder(api, folder)
        return [(d["uid"], upload(api, d, folder_uid, public)) for d in dashboards]
    except (GrafanaTimeoutError, OSError) as exc:
        raise OSError(
            f"cannot reach Grafana at {public} ({type(exc).__name__}): check --grafana-url "
            "and that Grafana is running"
        ) from exc
    except GrafanaException as exc:
        raise ValueError(refusal(exc, public)) from exc
    finally:
        api.client.s.close()  # the client never closes its HTTP session itself


def ensure_folder(api: GrafanaApi, title: str) -> str:
    """The uid of the top-level folder titled `title`, created if there is none."""
    folders = cast(list[dict[str, Any]], api.folder.get_all_folders())  # type: ignore[no-untyped-call]
    for folder in folders:
        if folder.get("title") == title:
            return str(folder["uid"])
    log.info("creating Grafana folder %r", title)
    created = cast(dict[str, Any], api.folder.create_folder(title))  # type: ignore[no-untyped-call]
    return str(created["uid"])


def upload(api: GrafanaApi, dashboard: JSON, folder_uid: str, public: str) -> str:
    body = {"dashboard": dashboard, "folderUid": folder_uid, "overwrite": True}
    response = cast(dict[str, Any], api.dashboard.update_dashboard(body))  # type: ignore[no-untyped-call]
    return urljoin(public, str(response["url"]))


def refusal(exc: GrafanaException, public: str) -> str:
    status = exc.status_code if isinstance(exc, GrafanaClientError) else None
    if status == 401:
        return (
            f"Grafana at {public} rejected the token (401 Unauthorized): pass a valid service "
            "account token with --token"
        )
    if status == 403:
        return (
            f"Grafana at {public} refused the upload (403 Forbidden): the token's service "
            "account needs the Editor role"
        )
    return f"Grafana at {public} refused the upload: {exc.message}"


def public_url(url: str) -> str:
    """`url` without user info (it may hold a password), query or fragment."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.hostname:
        raise ValueError("--grafana-url must be an http(s) URL such as http://grafana:3000")
    netloc = parts.netloc.rpartition("@")[2]
    # grafana-client appends "api" to the path as given: it must end in a slash
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/", "", ""))
