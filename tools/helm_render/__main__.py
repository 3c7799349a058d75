"""`helm template` / `helm lint` for machines without helm:

    python tools/helm_render template helm [-f my-values.yaml]... [--release NAME] [-n NAMESPACE]
    python tools/helm_render lint helm [-f my-values.yaml]...
    python tools/helm_render backend
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/helm_render ...`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from helm_render import HelmUnavailable, RenderError, backend, lint, merge_values, render, to_yaml  # noqa: E402


def _values(files: list[str]) -> dict:
    merged: dict = {}
    for name in files:
        merged = merge_values(merged, yaml.safe_load(Path(name).read_text()) or {})
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="helm_render", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tpl = sub.add_parser("template", help="render the chart like `helm template`")
    tpl.add_argument("chart")
    tpl.add_argument("-f", "--values", action="append", default=[])
    tpl.add_argument("--release", default="release")
    tpl.add_argument("-n", "--namespace", default="default")
    tpl.add_argument("--notes", action="store_true", help="print NOTES.txt too (sdk backend)")
    lnt = sub.add_parser("lint", help="lint the chart like `helm lint --strict`")
    lnt.add_argument("chart")
    lnt.add_argument("-f", "--values", action="append", default=[])
    sub.add_parser("backend", help="print which backend would be used")
    args = parser.parse_args(argv)
    try:
        if args.command == "backend":
            print(backend())
            return 0
        if args.command == "template":
            rendered = render(args.chart, _values(args.values), release=args.release,
                              namespace=args.namespace)
            sys.stdout.write(to_yaml(rendered))
            if args.notes and rendered.notes:
                sys.stdout.write("\nNOTES:\n" + rendered.notes)
            return 0
        report = lint(args.chart, _values(args.values))
        print("\n".join(report.messages))
        print(f"{'OK' if report.ok else 'FAILED'} ({report.backend})")
        return 0 if report.ok else 1
    except HelmUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    except RenderError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
