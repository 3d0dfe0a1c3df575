#!/usr/bin/env python3
"""The layering check: no import circle between the source files of any crate, and no file of
a lower layer importing one of a higher layer (the tables in `scripts/layers.toml`).

    scripts/layers.py            # check every crate; exit 1 on a circle, an upward import or a
                                 # file the table does not place
    scripts/layers.py --graph    # also print each file's imports

What counts as an import: every `crate::a::b` path outside comments (`use` lines, paths in
code, grouped `crate::{a, b::c}` imports), `super::` and `self::` paths, and paths that
start with a child module the file declares (`mod queues;` ... `queues::get_queue`),
resolved to the file that defines the longest matching module. A file may use its own ancestors (a child module is part of
its parent: `impl Queue` split over `queue/*.rs` needs `super::Queue`); every other edge counts,
parent to child included. Run by scripts/test (the README's test command).
"""

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "scripts/layers.toml"


def strip_comments(text: str) -> str:
    """Drop `//` comments (doc comments included), `/* */` blocks, and string literals' insides,
    keeping line structure."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 8]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            close = '"' + m.group(1)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            # a char literal ('"' would otherwise open a string); lifetimes pass through
            m = re.match(r"'(\\.|[^\\'])'", text[i:])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def module_of(src: Path, file: Path) -> tuple[str, ...]:
    rel = file.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def expand(path: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> [`a::b`, `a::c::d`, `a::c::e`]."""
    path = re.sub(r"\s+", "", path)
    m = path.find("{")
    if m < 0:
        return [path]
    head = path[:m]
    depth, start, parts = 0, m + 1, []
    for i in range(m, len(path)):
        if path[i] == "{":
            depth += 1
        elif path[i] == "}":
            depth -= 1
            if depth == 0:
                parts.append(path[start:i])
                break
        elif path[i] == "," and depth == 1:
            parts.append(path[start:i])
            start = i + 1
    out = []
    for p in parts:
        if p:
            out.extend(head + q for q in expand(p))
    return out


PATH = re.compile(r"\b(crate|super)((?:\s*::\s*(?:\{[^;]*?\}|[A-Za-z_][A-Za-z0-9_]*|\*))+)")


def whole_path(code: str, m: re.Match, text: str) -> str:
    """The path `m` starts, with its brace group whole: a group may span lines and nest."""
    if "{" not in text:
        return text
    depth, j = 0, m.start() + text.index("{")
    while j < len(code):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                break
        j += 1
    return code[m.start():j + 1]


def references(code: str, here: tuple[str, ...]) -> list[tuple[str, ...]]:
    refs = []
    for m in PATH.finditer(code):
        text = m.group(1) + m.group(2)
        text = whole_path(code, m, text)
        for full in expand(text):
            segs = [s for s in full.split("::") if s]
            if segs[0] == "crate":
                base, segs = (), segs[1:]
            else:
                # `super` at a file's top level is its parent; in an inline module (tests) it
                # is the file itself, which is resolved against the parent too and dropped by
                # the ancestor rule.
                base, segs = here[:-1], segs[1:]
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
            refs.append(tuple(base) + tuple(s for s in segs if s not in ("*", "self")))
    return refs


CHILD = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", re.M)


def relative_references(code: str, here: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Paths that start at this file's own module: `self::x` and `child::x` for a child module
    the file declares (`mod child;`), as a router's `queues::get_queue` or `use node::Node`."""
    children = CHILD.findall(code)
    names = ["self"] + children
    pat = re.compile(r"(?<![A-Za-z0-9_:])(" + "|".join(map(re.escape, names)) +
                     r")((?:\s*::\s*(?:\{[^;]*?\}|[A-Za-z_][A-Za-z0-9_]*|\*))+)")
    refs = []
    for m in pat.finditer(code):
        text = m.group(1) + m.group(2)
        text = whole_path(code, m, text)
        for full in expand(text):
            segs = [x for x in full.split("::") if x and x not in ("*", "self")]
            refs.append(tuple(here) + tuple(segs))
    return refs


def resolve(ref: tuple[str, ...], modules: set) -> tuple[str, ...]:
    for k in range(len(ref), -1, -1):
        if ref[:k] in modules:
            return ref[:k]
    return ()


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def layer_of(module: tuple[str, ...], table: list) -> tuple[int, str] | None:
    best = None
    for rank, layer in enumerate(table):
        for member in layer["modules"]:
            prefix = tuple(p for p in member.split("::") if p)
            if module[:len(prefix)] == prefix and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, layer["name"])
    return None if best is None else (best[1], best[2])


def show(m: tuple[str, ...]) -> str:
    return "::".join(m) or "crate"


def check_crate(name: str, spec: dict, graph: bool) -> list[str]:
    src = ROOT / spec["src"]
    files = sorted(p for p in src.rglob("*.rs"))
    mods, is_dir = {}, {}
    for f in files:
        m = module_of(src, f)
        mods[m] = f
        is_dir[m] = f.name in ("mod.rs", "lib.rs", "main.rs")
    modules = set(mods)
    edges: dict = {}
    for m, f in mods.items():
        code = strip_comments(f.read_text())
        for ref in references(code, m) + relative_references(code, m):
            target = resolve(ref, modules)
            if target == m or m[:len(target)] == target:
                continue  # itself or an ancestor
            edges.setdefault(m, set()).add(target)
    problems = []
    for comp in sccs(modules, edges):
        if len(comp) > 1:
            comp_set = set(comp)
            lines = [f"  {show(a)} -> {', '.join(show(b) for b in sorted(edges[a] & comp_set))}"
                     for a in sorted(comp)]
            problems.append(f"{name}: import circle among {len(comp)} files:\n" + "\n".join(lines))
    table = spec.get("layers", [])
    if table:
        for m in sorted(modules):
            if m == () or layer_of(m, table) is None and m[:1] == ("bin",):
                continue
            if layer_of(m, table) is None:
                problems.append(f"{name}: {mods[m].relative_to(ROOT)} is in no layer of scripts/layers.toml")
        for a in sorted(edges):
            la = layer_of(a, table) if a else None
            for b in sorted(edges[a]):
                lb = layer_of(b, table) if b else None
                if la and lb and lb[0] > la[0]:
                    problems.append(f"{name}: {show(a)} (layer {la[1]}) imports {show(b)} (layer {lb[1]}, above it)")
    if graph:
        for a in sorted(modules):
            la = layer_of(a, table) if table else None
            print(f"{name} {show(a)} [{la[1] if la else '-'}] -> {', '.join(show(b) for b in sorted(edges.get(a, ())))}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", action="store_true")
    args = p.parse_args()
    spec = tomllib.loads(TABLE.read_text())
    problems = []
    for name, crate in spec["crate"].items():
        problems += check_crate(name, crate, args.graph)
    for pr in problems:
        print(pr)
    crates = len(spec["crate"])
    if problems:
        print(f"layers: {len(problems)} problem(s) in {crates} crates")
        return 1
    print(f"layers: {crates} crates, no import circle, no upward import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
