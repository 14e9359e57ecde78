"""docs/operations.md's flag tables against the commands' own ``--help``.

Every flag of ``python -m dynamo_zmq.worker`` (with the mocker; with the vLLM adapter's own
flags), ``python -m dynamo_zmq.frontend`` (every router mode's flags included) and
``python -m router`` is a row of its tables (``<!-- flags: NAME -->`` before each) with the
``DYN_*`` variable its help names and its default; every row is a real flag; every variable sets
its flag's default. The only flags without a variable are ``-h/--help`` and vLLM's own engine
flags, which the vllm engine passes through (the last test, with vLLM installed).

The parsers are built in-process (``build_parser``): what they hold is what ``--help`` prints.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynamo_zmq.frontend.__main__ import build_parser as frontend_parser
from dynamo_zmq.frontend._http_security import http_security
from dynamo_zmq.llm import ENGINES, plugin_names
from dynamo_zmq.worker import build_parser as worker_parser
from engines.mocker import MockerEngine
from engines.vllm._options import add_adapter_args
from router.__main__ import build_parser as router_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
MARKER = re.compile(r"<!-- flags: (.+?) -->")
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
VARIABLE = re.compile(r"DYN_[A-Z0-9_]+")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _vllm_worker_parser() -> argparse.ArgumentParser:
    """The worker's parser with the vLLM adapter's own flags (vLLM's come from vLLM)."""
    parser = worker_parser()
    add_adapter_args(parser.add_argument_group("vllm engine"))
    return parser


#: Each command, how to build its parser, and the tables that document it.
CLIS: dict[str, tuple[Callable[[], argparse.ArgumentParser], tuple[str, ...]]] = {
    "worker --engine mocker": (
        lambda: worker_parser(MockerEngine), ("runtime", "worker", "worker --engine mocker")
    ),
    "worker --engine vllm": (_vllm_worker_parser, ("runtime", "worker", "worker --engine vllm")),
    "frontend": (frontend_parser, ("runtime", "frontend", "kv-router")),
    "router": (router_parser, ("runtime", "kv-router", "router")),
}


@dataclass(frozen=True)
class Row:
    flags: frozenset[str]
    variables: frozenset[str]
    default: str | None
    line: int


def _table_rows(lines: list[str], start: int) -> Iterator[Row]:
    """The rows of the table whose header is ``lines[start]`` (those with flags in column
    ``flag``; a table without ``flag`` and ``variable``/``env`` columns yields none)."""
    header = [c.strip().lower() for c in lines[start].strip().strip("|").split("|")]
    if "flag" not in header or not {"variable", "env"} & set(header):
        return
    flag_col = header.index("flag")
    var_col = header.index("variable" if "variable" in header else "env")
    default_col = header.index("default") if "default" in header else None
    for number in range(start + 2, len(lines)):
        line = lines[number]
        if not line.startswith("|"):
            return
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        yield Row(
            flags=frozenset(FLAG.findall(cells[flag_col])),
            variables=frozenset(VARIABLE.findall(cells[var_col])),
            default=cells[default_col] if default_col is not None else None,
            line=number + 1,
        )


def _doc() -> tuple[dict[str, list[Row]], list[Row]]:
    """The marked tables by name, and the rows of every table with flag and variable columns."""
    lines = DOC.read_text().splitlines()
    marked: dict[str, list[Row]] = {}
    every: list[Row] = []
    for number, line in enumerate(lines):
        if line.startswith("|") and (number == 0 or not lines[number - 1].startswith("|")):
            every += _table_rows(lines, number)
        if found := MARKER.fullmatch(line.strip()):
            header = next(n for n in range(number + 1, len(lines)) if lines[n].strip())
            assert lines[header].startswith("|"), f"operations.md:{number + 1}: no table follows"
            marked[found.group(1)] = list(_table_rows(lines, header))
    return marked, every


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _variables(action: argparse.Action) -> frozenset[str]:
    return frozenset(VARIABLE.findall(action.help or ""))


@pytest.fixture
def no_dyn_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``DYN_*`` variable set (conftest pins ``DYN_MDNS_INTERFACES``): the documented
    defaults."""
    for name in list(os.environ):
        if name.startswith("DYN_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _missing_rows(cli: str) -> list[str]:
    build, tables = CLIS[cli]
    marked, _ = _doc()
    rows = [row for name in tables for row in marked[name]]
    problems = []
    for action in _actions(build()):
        flag, helps = "/".join(action.option_strings), sorted(_variables(action))
        found = [row for row in rows if row.flags == frozenset(action.option_strings)]
        if not found:
            problems.append(f"{flag}: no row in {tables}")
        elif not helps:
            problems.append(f"{flag}: its help names no DYN_* variable")
        elif sorted(found[0].variables) != helps:
            problems.append(f"{flag}: operations.md:{found[0].line} says "
                            f"{sorted(found[0].variables)}, --help {helps}")
    return problems


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_every_flag_has_a_variable_and_a_row(cli: str) -> None:
    problems = _missing_rows(cli)
    assert not problems, "\n".join(problems)


def test_every_marked_table_exists_and_every_row_is_a_flag_of_its_commands() -> None:
    marked, _ = _doc()
    names = {name for _, tables in CLIS.values() for name in tables}
    users = {name: [cli for cli, (_, tables) in CLIS.items() if name in tables] for name in names}
    assert set(marked) == set(users), "operations.md's marked tables are not the commands'"
    flags = {cli: {frozenset(a.option_strings) for a in _actions(build())}
             for cli, (build, _) in CLIS.items()}
    unknown = [f"operations.md:{row.line}: {sorted(row.flags)} is no flag of {users[name]}"
               for name, rows in marked.items() for row in rows
               if not any(row.flags in flags[cli] for cli in users[name])]
    assert not unknown, "\n".join(unknown)


def test_every_flag_table_agrees_with_the_help() -> None:
    """Every table of operations.md with flag and variable columns (the topical ones too):
    its rows are real flags, with the variables their help names."""
    _, every = _doc()
    known = {(frozenset(a.option_strings), _variables(a))
             for build, _ in CLIS.values() for a in _actions(build())}
    wrong = [f"operations.md:{row.line}: {sorted(row.flags)} {sorted(row.variables)}"
             for row in every if (row.flags, row.variables) not in known]
    assert not wrong, "no flag has these variables:\n" + "\n".join(wrong)


def _documented_default(row: Row, value: Any) -> bool:
    """Whether a row's default column says ``value`` (numbers and strings; others pass)."""
    assert row.default is not None
    if isinstance(value, bool) or value is None or isinstance(value, list):
        return True
    if isinstance(value, (int, float)):
        return any(math.isclose(float(n), value) for n in NUMBER.findall(row.default))
    return f"`{value}`" in row.default


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_documented_defaults_are_the_parsers(cli: str, no_dyn_env: pytest.MonkeyPatch) -> None:
    build, tables = CLIS[cli]
    marked, _ = _doc()
    rows = {row.flags: row for name in tables for row in marked[name]}
    parser = build()
    parsed = vars(parser.parse_args([]))
    wrong = [f"operations.md:{rows[key].line}: {action.option_strings[0]} defaults to "
             f"{parsed[action.dest]!r}, the table says {rows[key].default!r}"
             for action in _actions(parser)
             if (key := frozenset(action.option_strings)) in rows
             and not _documented_default(rows[key], parsed[action.dest])]
    assert not wrong, "\n".join(wrong)


def _env_value(action: argparse.Action, default: Any) -> tuple[str, list[str]]:
    """A value for the action's variable, and the command line that means the same."""
    if action.nargs == 0:  # a switch: its help says the value (DYN_X=0 or DYN_X=1)
        found = re.search(r"DYN_[A-Z0-9_]+=([01])", action.help or "")
        assert found, f"{action.option_strings[0]}: a switch's help must say DYN_X=0 or =1"
        value = found.group(1)
        negative = [s for s in action.option_strings if s.startswith("--no-")]
        positive = [s for s in action.option_strings if not s.startswith("--no-")]
        is_boolean_optional = isinstance(action, argparse.BooleanOptionalAction)
        flag = (negative if is_boolean_optional and value == "0" else positive or negative)[0]
        return value, [flag]
    if action.choices is not None:
        value = next(str(c) for c in action.choices if c != default)
    elif action.type in (int, float):
        value = "7"
    else:
        value = "x-from-env"
    return value, [action.option_strings[0], value]


#: Flags whose variable is read after parsing, not as the flag's default.
READ_AFTER_PARSING = {"--api-key"}


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_each_variable_sets_its_flag(cli: str, no_dyn_env: pytest.MonkeyPatch) -> None:
    """All of a command's variables set at once, each to a value other than the default: every
    flag's value is then what the flag itself gives on the command line."""
    build = CLIS[cli][0]
    baseline = build()
    defaults = vars(baseline.parse_args([]))
    checked = [a for a in _actions(baseline) if a.option_strings[0] not in READ_AFTER_PARSING]
    given = {a.dest: _env_value(a, defaults[a.dest]) for a in checked}
    for action in checked:  # the first variable its help names is the flag's own
        no_dyn_env.setenv(VARIABLE.findall(action.help or "")[0], given[action.dest][0])
    from_env = vars(build().parse_args([]))  # defaults are read when the parser is built
    wrong = []
    for action in checked:
        flag_value = getattr(baseline.parse_args(given[action.dest][1]), action.dest)
        if from_env[action.dest] != flag_value or flag_value == defaults[action.dest]:
            wrong.append(f"{action.option_strings[0]}: from its variable {from_env[action.dest]!r},"
                         f" from the flag {flag_value!r}, default {defaults[action.dest]!r}")
    assert not wrong, "\n".join(wrong)


def test_dyn_api_keys_adds_to_the_api_keys(no_dyn_env: pytest.MonkeyPatch) -> None:
    no_dyn_env.setenv("DYN_API_KEYS", "from-env,other")
    keys, _, _ = http_security(frontend_parser().parse_args(["--api-key", "from-flag"]))
    assert all(keys.accepts(k) for k in (b"from-env", b"other", b"from-flag"))


def test_engine_help_lists_the_installed_engines() -> None:
    engine = next(a for a in worker_parser()._actions if "--engine" in a.option_strings)
    installed = plugin_names(ENGINES)
    assert {"mocker", "vllm"} <= set(installed)
    assert all(name in (engine.help or "") for name in installed), engine.help


def test_a_flag_without_a_row_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a flag added without documentation is reported."""
    def with_extra() -> argparse.ArgumentParser:
        parser = router_parser()
        parser.add_argument("--undocumented", help="[DYN_UNDOCUMENTED]")
        return parser

    monkeypatch.setitem(CLIS, "router", (with_extra, CLIS["router"][1]))
    assert _missing_rows("router") == ["--undocumented: no row in "
                                       "('runtime', 'kv-router', 'router')"]


def test_vllm_flags_beyond_the_adapters_are_vllms_own() -> None:
    """With vLLM installed, the flags ``--engine vllm`` adds beyond the adapter's own (which
    the tables document) are vLLM's ``AsyncEngineArgs`` flags, passed through."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM is not installed ({exc}); CI=true: the vLLM tests must run")
        pytest.skip(f"vLLM is not installed ({exc}); install the `vllm` extra")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from engines.vllm import VllmEngine

    source = FlexibleArgumentParser(add_help=False)
    AsyncEngineArgs.add_cli_args(source)
    vllms = {s for a in source._actions for s in a.option_strings}
    full = {s for a in _actions(worker_parser(VllmEngine)) for s in a.option_strings}
    own = {s for a in _actions(_vllm_worker_parser()) for s in a.option_strings}
    assert own <= full
    assert full - own and full - own <= vllms
