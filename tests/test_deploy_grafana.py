"""deploy/dashboards/gatehouse.json checked against Grafana's own published types.

Grafana itself is in no registry reachable here (not in Debian main, PyPI or npm; building
it from its Go module is out of proportion), so the strongest stand-in is the npm package
@grafana/schema, which Grafana generates from the CUE schemas its server and frontend use
for the dashboard JSON model and for each core panel plugin's options and field config,
released with every Grafana version.  The dashboard is emitted as a TypeScript object
literal with ``satisfies`` and compiled with tsc, so that:

* every key must be known to the type it sits in (excess-property checks on the literal),
  from the dashboard down to a panel's options, legend and field config;
* every enum-like value must be one the schema lists (``"displayMode": "table"``);
* each panel is checked against its own plugin's schema (``stat``, ``timeseries``,
  ``table``; an unknown panel type is an error), rows against the row panel type;
* each query against the Prometheus data source's query type (@grafana/prometheus).

Panel options and field config are checked as partial (Grafana fills in the plugin's
defaults for what a saved dashboard leaves out); everything else as the schema requires.
The checker's teeth are shown by broken copies of the dashboard that must each fail.
Tools: ``sh scripts/install_deploy_tools.sh`` (``make deploy-tools``).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.deploy import tools_dir

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "dashboards" / "gatehouse.json"
PANELCFG = "@grafana/schema/dist/esm/raw/composable/{0}/panelcfg/x/{1}PanelCfg_types.gen"
# Panel type -> (@grafana/schema's plugin directory, its type-name prefix, whether the
# plugin's schema has a custom FieldConfig).
PANEL_SCHEMAS = {
    "stat": ("stat", "Stat", False),
    "timeseries": ("timeseries", "TimeSeries", True),
    "table": ("table", "Table", True),
}

# Types over @grafana/schema.  Plain<T> is T as JSON spells it: a string enum's values
# become their literals (JSON has strings, not TypeScript enum members); number enums
# stay (a JSON number must be one of them).
PRELUDE = """\
import type {{ Dashboard, FieldConfig, FieldConfigSource, Panel, RowPanel }} from "@grafana/schema";
import type {{ Prometheus }} from "{prometheus}";
{imports}

type Plain<T> = T extends string ? `${{T}}` : T extends (infer U)[] ? Plain<U>[]
  : T extends object ? {{ [K in keyof T]: Plain<T[K]> }} : T;
type DeepPartial<T> = T extends string ? `${{T}}` : T extends (infer U)[] ? DeepPartial<U>[]
  : T extends object ? {{ [K in keyof T]?: DeepPartial<T[K]> }} : T;
type PanelOf<Type extends string, Options, Custom> =
  Omit<Panel, "type" | "options" | "fieldConfig" | "targets"> & {{
    type: Type;
    options?: DeepPartial<Options>;
    fieldConfig?: Omit<FieldConfigSource, "defaults"> & {{
      defaults: Omit<FieldConfig, "custom"> & {{ custom?: DeepPartial<Custom> }};
    }};
    targets?: Prometheus[];
  }};
type GatehousePanel = {panels};
type GatehouseRow = Omit<RowPanel, "panels"> & {{ panels: GatehousePanel[] }};
type GatehouseDashboard = Plain<Omit<Dashboard, "panels"> & {{
  panels: (GatehousePanel | GatehouseRow)[];
}}>;
"""

TSCONFIG = {"compilerOptions": {
    "strict": True, "noEmit": True, "target": "es2022", "module": "esnext",
    "moduleResolution": "bundler", "types": [],
    # The packages' own .d.ts are Grafana's to check (@grafana/prometheus's import types
    # of @grafana/data, not installed: only a query's `scopes` is left untyped by that).
    "skipLibCheck": True,
}, "files": ["dashboard.ts"]}

TSC_ERROR = re.compile(r"^dashboard\.ts\((\d+),(\d+)\): error (TS\d+): (.*)$")


def tools() -> tuple[Path, Path]:
    """tsc and @grafana/prometheus's query type, installed by install_deploy_tools.sh."""
    node = tools_dir() / "node" / "node_modules"
    tsc = node / "typescript" / "bin" / "tsc"
    prometheus = tools_dir() / "node" / "grafana-prometheus" / "package" / "dist" / "types"
    for needed in (tsc, node / "@grafana" / "schema", prometheus / "dataquery.d.ts"):
        if not needed.exists():
            pytest.fail(f"{needed} is missing: run `sh scripts/install_deploy_tools.sh` "
                        "(make test does)")
    return tsc, prometheus / "dataquery"


def prelude(prometheus: Path) -> str:
    imports, panels = [], []
    for panel_type, (directory, prefix, has_custom) in PANEL_SCHEMAS.items():
        module = directory  # the TypeScript name of the plugin's types
        imports.append(f'import type * as {module} from "{PANELCFG.format(directory, prefix)}";')
        custom = f"{module}.FieldConfig" if has_custom else "Record<string, never>"
        panels.append(f'PanelOf<"{panel_type}", {module}.Options, {custom}>')
    return PRELUDE.format(prometheus=prometheus, imports="\n".join(imports),
                          panels="\n  | ".join(panels))


def type_check(dashboards: list[dict[str, Any]], workdir: Path) -> list[list[str]]:
    """tsc's errors for each dashboard (one ``satisfies`` each, in one compilation), each
    error with the line of the literal it points at."""
    tsc, prometheus = tools()
    lines = prelude(prometheus).splitlines()
    spans = []
    for i, dashboard in enumerate(dashboards):
        start = len(lines) + 1
        literal = json.dumps(dashboard, indent=2).splitlines()
        lines += [f"export const dashboard{i} = {literal[0]}", *literal[1:-1],
                  f"{literal[-1]} satisfies GatehouseDashboard;"]
        spans.append((start, len(lines)))
    (workdir / "dashboard.ts").write_text("\n".join(lines) + "\n")
    (workdir / "tsconfig.json").write_text(json.dumps(TSCONFIG))
    (workdir / "node_modules").symlink_to(tools_dir() / "node" / "node_modules")
    result = subprocess.run(["node", str(tsc), "-p", ".", "--pretty", "false"], cwd=workdir,
                            capture_output=True, text=True, timeout=300)
    errors: list[list[str]] = [[] for _ in dashboards]
    last: list[str] | None = None
    for text in result.stdout.splitlines():
        match = TSC_ERROR.match(text)
        if match is None:
            # Only the indented continuation of the error before; anything else is tsc
            # failing for another reason (a bad config, a missing package).
            assert text.startswith(" ") and last, result.stdout + result.stderr
            last[-1] += f"\n{text}"
            continue
        line = int(match[1])
        owner = [i for i, (start, end) in enumerate(spans) if start <= line <= end]
        assert owner, f"an error outside the dashboards (the prelude is wrong): {text}"
        last = errors[owner[0]]
        last.append(f"{match[3]} {match[4]} (at: {lines[line - 1].strip()})")
    assert (result.returncode != 0) == any(errors), result.stdout + result.stderr
    return errors


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def panel_of(dashboard: dict[str, Any], panel_type: str) -> dict[str, Any]:
    return next(p for p in panels(dashboard) if p["type"] == panel_type)


def grafana_schema_version() -> int:
    """The dashboard schemaVersion of the Grafana release @grafana/schema comes from."""
    script = ("import('@grafana/schema').then(s => "
              "console.log(s.defaultDashboard.schemaVersion))")
    result = subprocess.run(["node", "-e", script], capture_output=True, text=True,
                            timeout=60, cwd=tools_dir() / "node")
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


# Broken copies of the dashboard, each a mistake Grafana's JSON model rejects or ignores.
Mutation = Callable[[dict[str, Any]], None]


def _unknown_dashboard_key(d: dict[str, Any]) -> None:
    d["refreshInterval"] = "30s"


def _cursor_sync_out_of_range(d: dict[str, Any]) -> None:
    d["graphTooltip"] = 3


def _legend_mode_misspelled(d: dict[str, Any]) -> None:
    panel_of(d, "timeseries")["options"]["legend"]["displayMode"] = "tabel"


def _stat_option_unknown(d: dict[str, Any]) -> None:
    panel_of(d, "stat")["options"]["colourMode"] = "value"


def _draw_style_unknown(d: dict[str, Any]) -> None:
    panel_of(d, "timeseries")["fieldConfig"]["defaults"]["custom"]["drawStyle"] = "curve"


def _query_key_misspelled(d: dict[str, Any]) -> None:
    panel_of(d, "timeseries")["targets"][0]["legend"] = "{{api}}"


def _query_without_expr(d: dict[str, Any]) -> None:
    del panel_of(d, "table")["targets"][0]["expr"]


def _angular_graph_panel(d: dict[str, Any]) -> None:
    panel_of(d, "timeseries")["type"] = "graph"  # the Angular panel, removed in Grafana 12


def _row_without_collapsed(d: dict[str, Any]) -> None:
    del panel_of(d, "row")["collapsed"]


def _variable_refresh_out_of_range(d: dict[str, Any]) -> None:
    d["templating"]["list"][1]["refresh"] = 5


MUTATIONS: dict[str, tuple[Mutation, str]] = {
    "unknown dashboard key": (_unknown_dashboard_key, '"refreshInterval"'),
    "cursor sync out of range": (_cursor_sync_out_of_range, "'3'"),
    "legend display mode misspelled": (_legend_mode_misspelled, '"tabel"'),
    "stat option unknown": (_stat_option_unknown, '"colourMode"'),
    "draw style unknown": (_draw_style_unknown, '"curve"'),
    "query key misspelled": (_query_key_misspelled, '"legend"'),
    "query without expr": (_query_without_expr, "expr"),
    "Angular graph panel": (_angular_graph_panel, '"graph"'),
    "row without collapsed": (_row_without_collapsed, "collapsed"),
    "variable refresh out of range": (_variable_refresh_out_of_range, "'5'"),
}


def test_dashboard_satisfies_grafanas_published_types(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["type"] for p in panels(dashboard)} <= {"row", *PANEL_SCHEMAS}
    [errors] = type_check([dashboard], tmp_path)
    assert errors == [], "\n".join(errors)
    # Grafana migrates an older schemaVersion on import, one newer than its own it cannot;
    # from 36 on, data sources are the {type, uid} references the types above require.
    assert 36 <= dashboard["schemaVersion"] <= grafana_schema_version()


def test_the_type_check_rejects_broken_dashboards(tmp_path: Path) -> None:
    original = json.loads(DASHBOARD.read_text())
    broken = []
    for mutate, _ in MUTATIONS.values():
        dashboard = copy.deepcopy(original)
        mutate(dashboard)
        broken.append(dashboard)
    results = type_check(broken, tmp_path)
    for (name, (_, expected)), errors in zip(MUTATIONS.items(), results, strict=True):
        assert errors, f"{name}: no error"
        assert any(expected in error for error in errors), (name, errors)
