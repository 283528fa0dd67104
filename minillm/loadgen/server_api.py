"""A server's records over HTTP: every page of ``GET /v1/traces`` and ``GET /v1/steps``, and
:func:`diagnose_server`, which fetches both and diagnoses them (``minillm diagnose --base-url``).
A server that keeps no traces (vLLM, SGLang, llama.cpp: ``/v1/traces`` answers 404) is diagnosed
from its Prometheus ``/metrics`` instead (:mod:`minillm.loadgen.server_metrics`), and says so."""
from __future__ import annotations

import time
from typing import Any

from minillm.core.records import as_traces
from minillm.core.trace import Trace
from minillm.metrics.diagnose import Diagnosis, diagnose, diagnose_server_histograms


class TracesNotServed(ValueError):
    """``GET /v1/traces`` answered 404: the server keeps no per-request traces (not minillm)."""


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def fetch_trace_items(base_url: str, request_ids: list[str] | None = None, api_key: str | None = None,
                      client=None, page_size: int = 1000) -> list[dict]:
    """The traces the key may read (only ``request_ids`` when given), oldest first, page by page
    (``?limit=`` and ``?after=`` the ``next`` cursor of the previous page, app.py), as the plain
    JSON items ``{"request_id", "events"}`` that a saved file holds."""
    import httpx
    own = client is None
    client = client or httpx.Client(timeout=60)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    items: list[dict] = []
    after: int | None = 0
    try:
        while after is not None:
            params: dict = {"limit": page_size, "after": after}
            if request_ids:
                params["request_id"] = ",".join(request_ids)
            r = client.get(_api_root(base_url) + "/v1/traces", params=params, headers=headers)
            if r.status_code == 404:
                raise TracesNotServed(f"GET /v1/traces answered 404: {r.text[:200]}")
            if r.status_code != 200:
                raise ValueError(f"GET /v1/traces answered {r.status_code}: {r.text[:200]}")
            page = r.json()
            items += page.get("data", [])
            after = page.get("next")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot read traces from {base_url}: {e}") from None
    finally:
        if own:
            client.close()
    return items


def fetch_traces(base_url: str, request_ids: list[str] | None = None, api_key: str | None = None,
                 client=None, page_size: int = 1000) -> list[Trace]:
    """:func:`fetch_trace_items` as :class:`~minillm.core.trace.Trace` objects."""
    return as_traces(fetch_trace_items(base_url, request_ids, api_key, client, page_size))


def fetch_steps(base_url: str, api_key: str | None = None, limit: int = 10_000,
                client=None) -> tuple[list[dict], str | None]:
    """``GET /v1/steps`` → (records, None), or ([], why) when the server has none or refuses
    (it needs the admin key when one is configured)."""
    import httpx
    own = client is None
    client = client or httpx.Client(timeout=60)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = client.get(_api_root(base_url) + "/v1/steps", params={"limit": limit}, headers=headers)
    except httpx.HTTPError as e:
        return [], f"GET /v1/steps failed: {e}"
    finally:
        if own:
            client.close()
    if r.status_code != 200:
        return [], (f"GET /v1/steps answered {r.status_code} "
                    "(the step records need the admin key when one is set)")
    return r.json().get("data", []), None


def diagnose_server(base_url: str, api_key: str | None = None, steps: bool = True,
                    page_size: int = 1000, metrics_window_s: float = 0.0) -> tuple[Diagnosis, dict[str, Any]]:
    """Fetch a server's traces (and steps) and diagnose them. Returns the diagnosis and what was
    fetched, in the file format :func:`load_input` reads (``{"traces", "steps"}``). A server without
    ``/v1/traces`` is diagnosed from its ``/metrics`` (:func:`diagnose_from_metrics`)."""
    try:
        items = fetch_trace_items(base_url, None, api_key, page_size=page_size)
    except TracesNotServed as e:
        return diagnose_from_metrics(base_url, metrics_window_s, str(e))
    records, why = fetch_steps(base_url, api_key) if steps else ([], None)
    d = diagnose(items, records)
    if why:
        d.notes.append(why + ": host/device split skipped")
    d.notes.append("source: the server's own traces (GET /v1/traces)")
    saved = {"source": _api_root(base_url), "fetched": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "traces": items, "steps": records}
    return d, saved


def diagnose_from_metrics(base_url: str, window_s: float = 0.0,
                          why: str = "") -> tuple[Diagnosis, dict[str, Any]]:
    """The diagnosis from the server's Prometheus histograms: everything since it started, or with
    ``window_s`` > 0 the deltas between two scrapes that far apart (the requests of that window)."""
    from minillm.loadgen.server_metrics import scrape, server_view
    before = None
    if window_s > 0:
        before, err = scrape(base_url)
        if before is None:
            raise ValueError(f"{why}; and {err}: nothing to diagnose from")
        time.sleep(window_s)
    after, err = scrape(base_url)
    if after is None:
        raise ValueError(f"{why}; and {err}: nothing to diagnose from" if why else err)
    view = server_view(after, before)
    notes = [why + ": no per-request traces, so no request is named"] if why else []
    d = diagnose_server_histograms(view.stages, view.source, view.window, notes=notes)
    saved = {"source": _api_root(base_url), "fetched": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "traces": [], "steps": [], "server_metrics": view.to_dict()}
    return d, saved
