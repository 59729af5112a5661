"""Write the CUDA sources as the upstream series carries them: every timing-probe block (`#ifdef KBIT_PROBE_*`,
`#ifndef KBIT_PROBE_*` and their `#else` branches) resolved as in the shipped build, where no probe macro is
defined, and the timeline marks (`KBIT_TIMELINE(j)`, empty there) left out. The probes exist for the leave-one-out and timeline builds of dev/build_variant.sh (wrong values, timing
only); the shipped library never defines them, so the stripped sources compile to the same SASS
(docs/UPSTREAMING.md, "What stays out of the series", says how that was checked).

    python dev/strip_probes.py                 # csrc/*.cu, *.cuh, *.h -> build/upstream_csrc/
    python dev/strip_probes.py --check         # exit 1 if a probe conditional is left that this script can't resolve
"""

import argparse
import re
import sys
from pathlib import Path

PROBE = re.compile(r"^\s*#\s*(ifdef|ifndef)\s+(KBIT_PROBE_\w+)")
OPEN = re.compile(r"^\s*#\s*if(def|ndef)?\b")
ELSE = re.compile(r"^\s*#\s*else\b")
ELIF = re.compile(r"^\s*#\s*elif\b")
ENDIF = re.compile(r"^\s*#\s*endif\b")
# the timeline marks: an empty macro in the shipped build; the statement lines that only call it go too
TIMELINE_LINE = re.compile(r"^\s*(#\s*define\s+KBIT_TIMELINE\(j\)\s*|(if \(i == 0\) )?KBIT_TIMELINE\(\d\);\s*)$")


def strip(text: str, name: str = "<text>") -> str:
    """The text with each probe conditional replaced by the branch the shipped build compiles. A frame on the
    stack is None for a conditional kept as it is, or a bool: whether the current branch of a probe block is kept.
    Raises ValueError on an `#elif` inside a probe block (not resolvable here) or unbalanced conditionals."""
    out = []
    stack: list[bool | None] = []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        live = all(frame is not False for frame in stack)
        probe = PROBE.match(line)
        if probe:
            stack.append(probe.group(1) == "ifndef")  # no probe macro is defined in the shipped build
            continue
        if OPEN.match(line):
            stack.append(None)
        elif ELIF.match(line) and stack and stack[-1] is not None:
            raise ValueError(f"{name}:{number}: #elif in a probe block")
        elif ELSE.match(line) and stack and stack[-1] is not None:
            stack[-1] = not stack[-1]
            continue
        elif ENDIF.match(line):
            if not stack:
                raise ValueError(f"{name}:{number}: #endif without #if")
            if stack.pop() is not None:
                continue
        if live and not TIMELINE_LINE.match(line):
            out.append(line)
    if stack:
        raise ValueError(f"{name}: {len(stack)} conditional(s) left open at the end")
    return "".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=Path(__file__).resolve().parent.parent / "csrc", type=Path)
    ap.add_argument("--out", default=Path(__file__).resolve().parent.parent / "build" / "upstream_csrc", type=Path)
    ap.add_argument("--check", action="store_true", help="only check that every file strips; write nothing")
    args = ap.parse_args()
    files = sorted(p for p in args.src.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    removed = 0
    for path in files:
        text = path.read_text()
        try:
            stripped = strip(text, path.name)
        except ValueError as e:
            sys.exit(f"strip_probes: {e}")
        left = [line for line in stripped.splitlines() if re.search(r"#\s*if.*KBIT_PROBE_|KBIT_TIMELINE", line)]
        if left:
            sys.exit(f"strip_probes: {path.name}: probe conditionals left: {left[:3]}")
        removed += text.count("\n") - stripped.count("\n")
        if not args.check:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / path.name).write_text(stripped)
    where = "checked" if args.check else f"written to {args.out}"
    print(f"strip_probes: {len(files)} files {where}; {removed} probe lines removed")


if __name__ == "__main__":
    main()
