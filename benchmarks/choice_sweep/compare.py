"""Compare old_side.py's and new_side.py's JSON: python compare.py OLD.json NEW.json [EXAMPLES]."""
import json
import re
import sys
from collections import Counter

old = json.load(open(sys.argv[1]))
new = json.load(open(sys.argv[2]))
# fields the old launchers had and the new launch types dropped, with the value that meant "off"
OLD_DEFAULTS = {"k_per_split": 0, "num_stages": 1, "ticket": 1, "fixed_point": 0, "fixed_ticket": 0,
                "stream_k": 0, "consumers": 2}
SHRUNK = ", shrunk to fit this GPU"


def same_launch(o, n):
    if o.get("kernel") != n.get("kernel"):
        return False
    for k in set(o) | set(n):
        ov = re.sub(f"({re.escape(SHRUNK)})+", SHRUNK, o[k]) if k == "source" and k in o else o.get(k)
        if k in o and k in n:
            if ov != n[k]:
                return False
        elif k in o:
            if OLD_DEFAULTS.get(k, "missing") != o[k]:
                return False
        else:
            return False
    return True


def same(o, n):
    if "terms" in o or "terms" in n:
        return "terms" in o and "terms" in n and same(o["terms"], n["terms"])
    if "error" in o or "error" in n or "line" in o:
        return o == n
    if o.get("kernel") == "cublas" or n.get("kernel") == "cublas":
        return o == n
    return (same_launch(o["launch"], n["launch"]) and len(o["shrink"]) == len(n["shrink"])
            and all(same_launch(a, b) for a, b in zip(o["shrink"], n["shrink"])))


bad = Counter()
examples = {}
for k in old:
    if k not in new:
        bad["missing"] += 1
        continue
    if not same(old[k], new[k]):
        p = k.split("|")
        cls = ("startup",) + tuple(p[3:6]) if p[1] == "startup" else ("launch",) + tuple(p[4:8])
        bad[cls] += 1
        examples.setdefault(cls, k)
launches = sum("|startup|" not in k for k in old)
print(f"{launches} launch cases, {len(old) - launches} start-up cases; {sum(bad.values())} differ")
for c, v in sorted(bad.items()):
    print(v, c)
for c, k in list(examples.items())[: int(sys.argv[3]) if len(sys.argv) > 3 else 3]:
    print("\n", k, "\nOLD", json.dumps(old[k])[:800], "\nNEW", json.dumps(new[k])[:800])
