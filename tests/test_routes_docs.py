"""docs/operations.md's "Routes" table lists exactly the routes the frontend serves.

The frontend answers from its route table (``dynamo_zmq.frontend._routes.ROUTES``: another
path is 404, another method 405), so the table is what it serves; the docs table must list the
same (path, method) pairs, its links must name sections of the page, and a running frontend
must serve each pair (neither 404 "no route" nor 405) and refuse another method with 405 and
an ``Allow`` header, in the route's error shape.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from dynamo_zmq.frontend._routes import ROUTES, route_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
MARKER = "<!-- routes -->"


def doc_rows() -> list[list[str]]:
    """The cells of the docs table's rows (after its header)."""
    text = DOC.read_text()
    assert MARKER in text, "docs/operations.md has no routes table"
    lines = text[text.index(MARKER):].splitlines()[1:]
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def served() -> set[tuple[str, str]]:
    return {(method, r.path) for r in ROUTES for method in r.methods}


def test_the_table_lists_exactly_the_routes_served() -> None:
    documented = []
    for cells in doc_rows():
        path = cells[0].strip("`")
        documented += [(m.strip(), path) for m in cells[1].split(",")]
        assert len(cells) == 5 and all(cells), cells  # what for, refuses, see: not empty
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == served()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_tables_links_name_sections_of_the_page() -> None:
    anchors = {slug(m) for m in re.findall(r"^#+ (.+)$", DOC.read_text(), re.M)}
    links = [link for cells in doc_rows() for link in re.findall(r"\]\(#([^)]+)\)", cells[4])]
    assert links and set(links) <= anchors, set(links) - anchors


def test_route_of_matches_one_segment_per_placeholder() -> None:
    assert route_of("/v1/responses/resp_1") is route_of("/v1/responses/x")
    assert route_of("/v1/responses/resp_1") is not None
    for path in ("/v1/responses/", "/v1/responses/a/b", "/v1/chat/completions/", "/nope"):
        assert route_of(path) is None, path


@pytest.fixture
def url(spawn, namespace, tmp_path) -> str:
    """A frontend (no workers: no request reaches one)."""
    return spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace",
                 namespace, "--batch-dir", str(tmp_path / "batches")).address


def test_a_frontend_serves_each_route_and_refuses_other_methods(url) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path in sorted(served()):
            concrete = path.replace("{id}", "resp_x")
            resp = http.request(method, concrete, content=b"{}" if method == "POST" else None)
            assert resp.status_code != 405 and b"no route" not in resp.content, (
                method, path, resp.status_code, resp.text)
        for route in ROUTES:
            concrete = route.path.replace("{id}", "resp_x")
            resp = http.request("PATCH", concrete)
            assert resp.status_code == 405, (route, resp.text)
            assert set(resp.headers["allow"].split(", ")) == set(route.methods)
            body = resp.json()
            if route.path.startswith("/v1/messages"):  # Anthropic's shape
                assert body["type"] == "error", body
                assert body["error"]["type"] == "invalid_request_error", body
            else:
                assert body["error"]["type"] == "invalid_request_error", body
        resp = http.get("/v1/nope")
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
