#!/usr/bin/env python3
"""No function in driver/ is longer than the limit (DESIGN.md "Layers": the driver assembles and
reports; what it does at length belongs in a role or a module of its own).

    python3 regression/function_length.py [--root DIR] [--limit 80] [--top 5]
    python3 regression/function_length.py --planted   # proves it fails: a copy of driver/main.cpp
                                                      # with one function grown past the limit

Prints the longest functions (file:line, lines, name) and exits 1 naming each one over the limit.
A function is counted from the line of its opening brace to the line of its closing one; lambdas
count as part of the function that holds them. A heuristic parser (comments and strings removed,
braces matched), not a compiler: it knows function bodies from class, namespace, control-flow and
initializer braces by the text before the brace. driver/'s tests are not counted.
Standard library only.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

SOURCE_EXT = (".cpp", ".hpp")
CONTROL = {"if", "for", "while", "switch", "catch", "do", "else", "try"}
TYPE_HEAD = re.compile(r"\b(class|struct|union|enum|namespace)\b[^()]*$")


def strip(text):
    """Comments and string/char literals blanked, newlines kept (so line numbers hold)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def is_function_head(head):
    """Whether the text before a `{` opens a function body."""
    h = " ".join(head.split())
    if not h or ")" not in h or TYPE_HEAD.search(h):
        return False
    first = re.match(r"[A-Za-z_]\w*", h)
    if first and first.group(0) in CONTROL:
        return False
    if re.search(r"\]\s*(\([^)]*\))?\s*(mutable\s*)?(->[^{]*)?$", h):  # a lambda
        return False
    # What follows the parameter list: qualifiers, a trailing return type or a constructor's
    # initializer list, never an operator or a comma (an initializer, a call's brace argument).
    tail = h[h.rfind(")") + 1:].strip()
    if re.search(r"[=,;(]|^\)", tail) or re.search(r"[=,(]\s*$", h[: h.find("(")]):
        return False
    return re.search(r"[\w>~\]]\s*\(", h) is not None


def functions(path, rel):
    """(rel, first line, lines, name) of every function defined in the file, lambdas inside theirs."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = strip(f.read())
    found, stack, head_start, line = [], [], 0, 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c in ";}":
            if c == "}" and stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    found.append((rel, start, line - start + 1, name))
            head_start = i + 1
        elif c == "{":
            head = text[head_start:i]
            inside = any(k == "function" for k, _, _ in stack)
            if not inside and is_function_head(head):
                before = head[: head.find("(")].split()
                name = before[-1] if before else "?"
                stack.append(("function", line, name))
            else:
                stack.append(("block", line, ""))
            head_start = i + 1
    return found


def scan(root):
    found = []
    base = os.path.join(root, "driver")
    for dirpath, _, files in os.walk(base):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if "/test" in "/" + rel_dir[len("driver"):] + "/":
            continue
        for f in sorted(files):
            if f.endswith(SOURCE_EXT):
                found += functions(os.path.join(dirpath, f), rel_dir + "/" + f)
    return sorted(found, key=lambda x: -x[2])


def check(root, limit, top):
    found = scan(root)
    if not found:
        print("no function found under %s/driver" % root)
        return 1
    print("the longest functions in driver/ (limit %d lines):" % limit)
    for rel, start, n, name in found[:top]:
        print("  %4d lines  %s:%d  %s" % (n, rel, start, name))
    over = [f for f in found if f[2] > limit]
    for rel, start, n, name in over:
        print("FAIL: %s:%d %s is %d lines, over %d" % (rel, start, name, n, limit))
    if not over:
        print("OK: %d functions, none over %d lines" % (len(found), limit))
    return 1 if over else 0


def planted(root, limit):
    tmp = tempfile.mkdtemp(prefix="loom-fnlen-")
    try:
        shutil.copytree(os.path.join(root, "driver"), os.path.join(tmp, "driver"))
        with open(os.path.join(tmp, "driver", "planted.cpp"), "w") as f:
            f.write("int planted_long(int x) {\n" + "  x += 1;\n" * (limit + 5) + "  return x;\n}\n")
        check(tmp, limit, 3)
        caught = [f for f in scan(tmp) if f[3] == "planted_long" and f[2] > limit]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not caught:
        print("FAIL: a planted %d-line function was not caught" % (limit + 7))
        return 1
    print("OK: the planted function was caught")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--planted", action="store_true")
    a = ap.parse_args()
    sys.exit(planted(a.root, a.limit) if a.planted else check(a.root, a.limit, a.top))


if __name__ == "__main__":
    main()
