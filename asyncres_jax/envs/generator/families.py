"""The task families: each builds a Spec for a difficulty (easy = one short command, medium = a few, hard =
many steps) and a variant, from a random.Random. `params` records the categorical choices (file names,
keywords, ...) that split assignment hashes, so that held-out parameter combinations never reach training.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import random
from typing import Callable

from asyncres_jax.envs.generator.spec import File, Spec, lines_text, q

WORDS = ("alpha bravo cedar delta ember falcon garnet harbor indigo juniper kestrel lumen maple nectar onyx "
         "pepper quartz raven sable timber umber velvet willow xenon yonder zephyr amber birch cobalt dune "
         "fjord glacier heron iris jasper koala lotus meadow nova orchid pine quill ridge summit tulip "
         "violet walnut").split()
NAMES = ("ava ben cara dev eli fay gus hana ivan jade kai lena milo nina omar pia quinn rosa sam tara uma "
         "vik wren xia yara zane").split()
DEPTS = ("eng", "ops", "sales", "legal", "design", "finance")
LEVELS = ("DEBUG", "INFO", "WARN", "ERROR")
COMPONENTS = ("auth", "db", "cache", "api", "worker", "scheduler", "mailer")
PATHS = ("/", "/login", "/logout", "/api/items", "/api/users", "/static/app.js", "/health", "/search")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    domain: str
    variants: tuple[str, ...]
    held_out: tuple[str, ...]  # variants only the test split ever sees
    build: Callable[[random.Random, str, str], Spec]


FAMILIES: dict[str, Family] = {}


def family(name: str, domain: str, variants: tuple[str, ...], held_out: tuple[str, ...] = ()):
    def register(fn):
        FAMILIES[name] = Family(name, domain, variants, held_out, fn)
        return fn

    return register


def sentence(rng: random.Random, lo: int = 3, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def answer_checks(path: str, value) -> list[tuple[str, str]]:
    return [("answer_exists", f"assert (HOME / {path!r}).is_file()"),
            ("answer_is_single_line", f"assert len(nonblank({path!r})) == 1"),
            ("answer_value", f"assert text({path!r}).strip() == {str(value)!r}")]


def lines_checks(path: str, expected: list[str], ordered: bool = True) -> list[tuple[str, str]]:
    got = f"nonblank({path!r})" if ordered else f"sorted(nonblank({path!r}))"
    want = expected if ordered else sorted(expected)
    return [("output_exists", f"assert (HOME / {path!r}).is_file()"),
            ("line_count", f"assert len(nonblank({path!r})) == {len(expected)}"),
            ("first_line", f"assert nonblank({path!r})[:1] == {want[:1]!r}"),
            ("all_lines", f"assert {got} == {want!r}")]


def unchanged(path: str, content: str, name: str = "source_unchanged") -> tuple[str, str]:
    return (name, f"assert text({path!r}) == {content!r}")


# --- counting and aggregation -----------------------------------------------------------------------------

@family("count", "counting", ("lines", "matches", "words"), held_out=("words",))
def _count(rng, difficulty, variant):
    folder = rng.choice(("notes", "docs", "data", "texts"))
    kw = rng.choice(WORDS[:20])
    n_files = {"easy": 1, "medium": rng.randint(2, 4), "hard": rng.randint(3, 5)}[difficulty]
    names = sorted(rng.sample(WORDS, n_files))
    files = []
    for nm in names:
        body = [sentence(rng) for _ in range(rng.randint(4, 14))]
        for _ in range(rng.randint(1, 3)):
            body.insert(rng.randrange(len(body) + 1), f"{sentence(rng, 1, 3)} {kw} {sentence(rng, 1, 3)}")
        files.append(File(f"{folder}/{nm}.txt", lines_text(body)))

    def measure(t: str) -> int:
        ls = t.splitlines()
        if variant == "lines":
            return len(ls)
        if variant == "words":
            return len(t.split())
        return sum(kw in ln for ln in ls)

    what = {"lines": "lines", "words": "words (whitespace-separated)", "matches": f"lines containing `{kw}`"}[variant]
    tool = {"lines": "wc -l", "words": "wc -w", "matches": f"grep -c {kw}"}[variant]
    if difficulty == "easy":
        f = files[0]
        instr = f"Count the {what} in /home/user/{f.path} and write just the number to /home/user/answer.txt."
        sol = f"{tool} < {f.path} > answer.txt" if variant != "matches" else f"grep -c {kw} {f.path} > answer.txt"
        return Spec(instr, sol, answer_checks("answer.txt", measure(f.text)) + [unchanged(f.path, f.text)],
                    files, outputs=["answer.txt"], params=(folder, names[0]))
    if difficulty == "medium":
        total = sum(measure(f.text) for f in files)
        instr = (f"Count the {what} across all the .txt files in /home/user/{folder} together and write the total "
                 "to /home/user/answer.txt (just the number).")
        sol = f"cat {folder}/*.txt | {tool} > answer.txt" if variant != "matches" else \
            f"cat {folder}/*.txt | grep -c {kw} > answer.txt"
        return Spec(instr, sol, answer_checks("answer.txt", total), files, outputs=["answer.txt"],
                    params=(folder, kw, n_files))
    rows = [f"{f.path.split('/')[-1]},{measure(f.text)}" for f in files]
    instr = (f"For every .txt file in /home/user/{folder}, count its {what}. Write /home/user/report.csv with "
             "the header `file,count` and one row per file (`name.txt,N`, the file name without its folder), "
             "sorted by file name. Then write the sum of all counts to /home/user/total.txt.")
    one = f"$({tool} < \"$f\")" if variant != "matches" else f"$(grep -c {kw} \"$f\" || true)"
    sol = (f"echo file,count > report.csv\n"
           f"for f in {folder}/*.txt; do echo \"$(basename \"$f\"),{one}\" >> report.csv; done\n"
           "awk -F, 'NR > 1 {s += $2} END {print s}' report.csv > total.txt")
    total = sum(measure(f.text) for f in files)
    checks = [("report_exists", "assert (HOME / 'report.csv').is_file()"),
              ("header", "assert nonblank('report.csv')[0] == 'file,count'"),
              ("rows", f"assert nonblank('report.csv')[1:] == {rows!r}"),
              ("total", f"assert text('total.txt').strip() == {str(total)!r}")]
    return Spec(instr, sol, checks, files, outputs=["report.csv", "total.txt"], params=(folder, kw, n_files))


# --- search and replace -----------------------------------------------------------------------------------

@family("replace", "search_replace", ("word", "path"), held_out=("path",))
def _replace(rng, difficulty, variant):
    if variant == "word":
        old, new = rng.sample(WORDS, 2)
        sed = f"s/\\b{old}\\b/{new}/g"
    else:
        old = f"/opt/{rng.choice(WORDS)}/{rng.choice(('bin', 'lib', 'data'))}"
        new = f"/srv/{rng.choice(WORDS)}/{rng.choice(('bin', 'lib', 'data'))}"
        sed = f"s|{old}|{new}|g"

    def body(with_old: bool) -> str:
        ls = [sentence(rng) for _ in range(rng.randint(4, 10))]
        if with_old:
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(ls))
                ls[i] = (f"{ls[i]} {old} {sentence(rng, 1, 2)}" if variant == "word"
                         else f"path = {old}/{rng.choice(WORDS)}")
        return lines_text(ls)

    def replaced(t: str) -> str:
        if variant == "path":
            return t.replace(old, new)
        return "\n".join(" ".join(new if w == old else w for w in ln.split(" ")) for ln in t.split("\n"))

    folder = rng.choice(("etc", "conf", "settings"))
    what = f"the word `{old}` with `{new}`" if variant == "word" else f"the path `{old}` with `{new}`"
    if difficulty == "easy":
        f = File(f"{folder}/app.conf", body(True))
        return Spec(f"In /home/user/{f.path}, replace every occurrence of {what}.", f"sed -i '{sed}' {f.path}",
                    [("replaced", f"assert text({f.path!r}) == {replaced(f.text)!r}"),
                     ("no_old_left",
                      f"assert {old!r} not in text({f.path!r}){'.split()' if variant == 'word' else ''}")],
                    [f], params=(folder, old, new))
    n = rng.randint(2, 4)
    confs = [File(f"{folder}/{w}.conf", body(True)) for w in sorted(rng.sample(WORDS, n))]
    other = File(f"{folder}/README.txt", body(True))
    files = confs + [other]
    if difficulty == "medium":
        instr = (f"In every .conf file in /home/user/{folder}, replace every occurrence of {what}. Leave other "
                 "files unchanged.")
        checks = [(f"replaced_{i}", f"assert text({f.path!r}) == {replaced(f.text)!r}") for i, f in enumerate(confs)]
        checks.append(unchanged(other.path, other.text, "other_files_unchanged"))
        return Spec(instr, f"sed -i '{sed}' {folder}/*.conf", checks, files, params=(folder, old, new, n))
    instr = (f"In every .conf file in /home/user/{folder}, replace every occurrence of {what}. Before changing a "
             "file, save its original as the same name plus `.bak` (e.g. app.conf.bak). Write the names of the "
             "changed .conf files (without folder), sorted, one per line, to /home/user/changed.txt. Leave other "
             "files unchanged.")
    sol = (f"for f in {folder}/*.conf; do cp \"$f\" \"$f.bak\"; sed -i '{sed}' \"$f\"; done\n"
           f"ls {folder} | grep '\\.conf$' | sort > changed.txt")
    checks = [(f"replaced_{i}", f"assert text({f.path!r}) == {replaced(f.text)!r}") for i, f in enumerate(confs)]
    checks += [(f"backup_{i}", f"assert text({f.path + '.bak'!r}) == {f.text!r}") for i, f in enumerate(confs)]
    checks += [("changed_list", f"assert nonblank('changed.txt') == {[f.path.split('/')[-1] for f in confs]!r}"),
               unchanged(other.path, other.text, "other_files_unchanged")]
    return Spec(instr, sol, checks, files, outputs=["changed.txt"], params=(folder, old, new, n))


# --- CSV ----------------------------------------------------------------------------------------------------

@family("csv", "csv_json", ("comma", "semicolon", "tab"), held_out=("tab",))
def _csv(rng, difficulty, variant):
    sep = {"comma": ",", "semicolon": ";", "tab": "\t"}[variant]
    sep_name = {"comma": "commas", "semicolon": "semicolons", "tab": "tabs"}[variant]
    fname = rng.choice(("staff", "people", "employees", "roster"))
    header = ["name", "dept", "salary", "age"]
    names = rng.sample(NAMES, rng.randint(6, 12))
    rows = [[n, rng.choice(DEPTS[:4]), str(rng.randrange(30, 150) * 1000), str(rng.randint(21, 64))] for n in names]
    f = File(f"{fname}.csv", lines_text(sep.join(r) for r in [header] + rows))
    cut_d = "$'\\t'" if variant == "tab" else q(sep)
    base = f"/home/user/{f.path} has a header line and fields separated by {sep_name}."
    if difficulty == "easy":
        col = rng.choice(("name", "dept", "age"))
        k = header.index(col) + 1
        want = [r[k - 1] for r in rows]
        instr = (f"{base} Write the values of its `{col}` column (no header), in file order, one per line, "
                 "to /home/user/out.txt.")
        return Spec(instr, f"tail -n +2 {f.path} | cut -d {cut_d} -f{k} > out.txt",
                    lines_checks("out.txt", want), [f], outputs=["out.txt"], params=(fname, col, len(rows)))
    dept = rng.choice(sorted({r[1] for r in rows}))
    if difficulty == "medium":
        want = [sep.join(header)] + [sep.join(r) for r in rows if r[1] == dept]
        instr = (f"{base} Write to /home/user/{dept}.csv the header line followed by the rows whose dept is "
                 f"`{dept}`, in their original order, with the same separator.")
        awk_sep = "\\t" if variant == "tab" else sep
        sol = f"head -n 1 {f.path} > {dept}.csv\nawk -F '{awk_sep}' '$2 == \"{dept}\"' {f.path} >> {dept}.csv"
        return Spec(instr, sol, lines_checks(f"{dept}.csv", want), [f], outputs=[f"{dept}.csv"],
                    params=(fname, dept, len(rows)))
    totals = collections.Counter()
    for r in rows:
        totals[r[1]] += int(r[2])
    want = ["dept,total,count"] + [f"{d},{totals[d]},{sum(r[1] == d for r in rows)}" for d in sorted(totals)]
    instr = (f"{base} Write /home/user/summary.csv (comma-separated) with the header `dept,total,count` and one "
             "row per department: the sum of its salaries and its number of people, sorted by department name. "
             "Also write the name of the department with the highest total to /home/user/top.txt.")
    awk_sep = "\\t" if variant == "tab" else sep
    sol = (f"echo dept,total,count > summary.csv\n"
           f"tail -n +2 {f.path} | awk -F '{awk_sep}' "
           f"'{{t[$2]+=$3; c[$2]++}} END {{for (d in t) print d\",\"t[d]\",\"c[d]}}' "
           "| sort >> summary.csv\ntail -n +2 summary.csv | sort -t, -k2,2nr | head -n 1 | cut -d, -f1 > top.txt")
    top = max(sorted(totals), key=lambda d: totals[d])
    if list(totals.values()).count(totals[top]) > 1:  # a tie would make top.txt ambiguous: draw again
        return _csv(rng, difficulty, variant)
    checks = lines_checks("summary.csv", want) + [("top", f"assert text('top.txt').strip() == {top!r}")]
    return Spec(instr, sol, checks, [f], outputs=["summary.csv", "top.txt"], params=(fname, names[0]))


# --- JSON ---------------------------------------------------------------------------------------------------

@family("json", "csv_json", ("flat", "nested"), held_out=("nested",))
def _json(rng, difficulty, variant):
    import json

    fname = rng.choice(("records", "inventory", "tickets", "jobs"))
    statuses = ("open", "closed", "pending")
    items = [{"id": i + 1, "name": f"{rng.choice(WORDS)}-{i + 1}", "status": rng.choice(statuses),
              "score": rng.randint(1, 100)} for i in range(rng.randint(5, 10))]
    doc = items if variant == "flat" else {"meta": {"version": rng.randint(1, 9)}, "data": {"items": items}}
    f = File(f"{fname}.json", json.dumps(doc, indent=2) + "\n")
    where = "a JSON list of objects" if variant == "flat" else 'a JSON object whose objects are in ["data"]["items"]'
    load = "json.load(open(%r))" % f.path if variant == "flat" else "json.load(open(%r))['data']['items']" % f.path
    if difficulty == "easy":
        k = rng.randrange(len(items))
        field = rng.choice(("name", "status", "score"))
        instr = (f"/home/user/{f.path} holds {where} with fields id, name, status and score. Write the {field} of "
                 f"the object with id {k + 1} to /home/user/answer.txt.")
        sol = f"python3 -c \"import json; print([o for o in {load} if o['id'] == {k + 1}][0]['{field}'])\" > answer.txt"
        return Spec(instr, sol, answer_checks("answer.txt", items[k][field]), [f], outputs=["answer.txt"],
                    params=(fname, field, k))
    status = rng.choice(sorted({o["status"] for o in items}))
    if difficulty == "medium":
        want = sorted(o["name"] for o in items if o["status"] == status)
        instr = (f"/home/user/{f.path} holds {where} with fields id, name, status and score. Write the names of "
                 f"the objects whose status is `{status}`, sorted alphabetically, one per line, "
                 "to /home/user/names.txt.")
        sol = (f"python3 -c \"import json; print('\\n'.join(sorted(o['name'] for o in {load} "
               f"if o['status'] == '{status}')))\""
               " > names.txt")
        return Spec(instr, sol, lines_checks("names.txt", want), [f], outputs=["names.txt"],
                    params=(fname, status, len(items)))
    by = {s: sum(o["status"] == s for o in items) for s in sorted({o["status"] for o in items})}
    total = sum(o["score"] for o in items)
    best = max(items, key=lambda o: (o["score"], -o["id"]))["name"]
    instr = (f"/home/user/{f.path} holds {where} with fields id, name, status and score. Write "
             "/home/user/summary.json: a JSON object with keys `count` (number of objects), `total_score` (sum of "
             "scores), `by_status` (an object mapping each status that occurs to its number of objects) and `best` "
             "(the name of the object with the highest score; the lowest id wins a tie).")
    sol = ("python3 - <<'PY'\nimport json\n"
           f"items = {load}\n"
           "by = {}\nfor o in items:\n    by[o['status']] = by.get(o['status'], 0) + 1\n"
           "best = max(items, key=lambda o: (o['score'], -o['id']))['name']\n"
           "json.dump({'count': len(items), 'total_score': sum(o['score'] for o in items), 'by_status': by, "
           "'best': best}, open('summary.json', 'w'))\nPY")
    load_out = "json.loads(text('summary.json'))"
    checks = [("valid_json", f"assert isinstance({load_out}, dict)"),
              ("count", f"assert {load_out}['count'] == {len(items)}"),
              ("total_score", f"assert {load_out}['total_score'] == {total}"),
              ("by_status", f"assert {load_out}['by_status'] == {by!r}"),
              ("best", f"assert {load_out}['best'] == {best!r}")]
    return Spec(instr, sol, checks, [f], outputs=["summary.json"], params=(fname, best.split("-")[0]))


# --- archives -----------------------------------------------------------------------------------------------

@family("archive", "archives", ("tar.gz", "tar"), held_out=("tar",))
def _archive(rng, difficulty, variant):
    z = "z" if variant == "tar.gz" else ""
    mode = "r:gz" if variant == "tar.gz" else "r:"
    src = rng.choice(("docs", "project", "reports", "site"))
    names = sorted(rng.sample(WORDS, rng.randint(2, 4)))
    files = [File(f"{src}/{n}.txt", lines_text(sentence(rng) for _ in range(3))) for n in names]
    logs = [File(f"{src}/{n}.log", lines_text(sentence(rng) for _ in range(2))) for n in
            sorted(rng.sample(WORDS, rng.randint(1, 3)))] if difficulty == "hard" else []
    arc = f"{src}.{variant}"
    members = ("import tarfile\nwith tarfile.open(HOME / %r, %r) as t:\n"
               "    names = sorted(m.name.rstrip('/').removeprefix('./') for m in t.getmembers() if m.isfile())\n")
    if difficulty == "easy":
        instr = (f"Create the archive /home/user/{arc} ({variant}) of the folder /home/user/{src}, "
                 f"with paths starting at `{src}/`.")
        want = sorted(f.path for f in files)
        checks = [("archive_exists", f"assert (HOME / {arc!r}).is_file()"),
                  ("members", (members % (arc, mode)) + f"assert names == {want!r}"),
                  ("content", "import tarfile\nwith tarfile.open(HOME / %r, %r) as t:\n"
                              "    assert t.extractfile(%r).read().decode() == %r"
                   % (arc, mode, want[0], files[0].text))]
        return Spec(instr, f"tar c{z}f {arc} {src}", checks, files, outputs=[arc], params=(src, tuple(names)))
    dest = rng.choice(("restore", "unpacked", "out"))
    if difficulty == "medium":
        instr = f"Extract the archive /home/user/backup.{variant} into the folder /home/user/{dest} (create it)."
        checks = [("dest_exists", f"assert (HOME / {dest!r}).is_dir()")]
        checks += [(f"file_{i}", f"assert text({dest + '/' + f.path!r}) == {f.text!r}") for i, f in enumerate(files)]
        return Spec(instr, f"mkdir -p {dest} && tar x{z}f backup.{variant} -C {dest}", checks, files,
                    outputs=[dest, src], prep=[f"tar c{z}f backup.{variant} {src}", f"rm -r {src}"],
                    params=(src, dest, names[0]))
    out = f"logs.{variant}"
    instr = (f"Extract /home/user/backup.{variant} into /home/user/{dest}. Then create /home/user/{out} ({variant}) "
             f"containing only the .log files from it, stored without folders (just the file names), and delete "
             f"the .log files from /home/user/{dest}.")
    sol = (f"mkdir -p {dest} && tar x{z}f backup.{variant} -C {dest}\ncd {dest}/{src}\n"
           f"tar c{z}f /home/user/{out} *.log\nrm -f *.log")
    checks = [("extracted_txt", f"assert sorted(p.name for p in (HOME / {dest!r} / {src!r}).iterdir()) == "
                                f"{[f.path.split('/')[-1] for f in files]!r}"),
              ("logs_archive",
               (members % (out, mode)) + f"assert names == {sorted(f.path.split('/')[-1] for f in logs)!r}"),
              ("log_content", "import tarfile\nwith tarfile.open(HOME / %r, %r) as t:\n"
                              "    assert t.extractfile(%r).read().decode() == %r"
               % (out, mode, logs[0].path.split("/")[-1], logs[0].text))]
    return Spec(instr, sol, checks, files + logs, outputs=[dest, out, src],
                prep=[f"tar c{z}f backup.{variant} {src}", f"rm -r {src}"], params=(src, dest, names[0]))


# --- permissions ------------------------------------------------------------------------------------------

SYMBOLIC = {0o600: "readable and writable by its owner only", 0o644: "readable by everyone, writable by its owner only",
            0o755: "readable and executable by everyone, writable by its owner only",
            0o700: "accessible by its owner only",
            0o640: "readable and writable by its owner, readable by its group, nothing for others"}


@family("permissions", "permissions", ("octal", "words"), held_out=("words",))
def _permissions(rng, difficulty, variant):
    def say(m: int) -> str:
        return f"mode {m:o}" if variant == "octal" else SYMBOLIC[m]

    if difficulty == "easy":
        name = rng.choice(("secret.key", "token.txt", "id_backup", "vault.db"))
        m = rng.choice((0o600, 0o640, 0o700))
        f = File(name, lines_text([hashlib.sha1(rng.randbytes(8)).hexdigest()]), mode=0o666)
        return Spec(f"Make /home/user/{name} {say(m)}.", f"chmod {m:o} {name}",
                    [("mode", f"assert mode({name!r}) == {oct(m)}"), unchanged(name, f.text)], [f],
                    params=(name, m, f.text[:2]))
    folder = rng.choice(("scripts", "bin", "tools"))
    sh = [File(f"{folder}/{w}.sh", lines_text(["#!/bin/sh", f"echo {w}"]), mode=0o644)
          for w in sorted(rng.sample(WORDS, rng.randint(2, 4)))]
    txt = [File(f"{folder}/{w}.txt", lines_text([sentence(rng)]), mode=0o755)
           for w in sorted(rng.sample(WORDS, rng.randint(1, 3)))]
    if difficulty == "medium":
        instr = (f"In /home/user/{folder}, make every .sh file {say(0o755)}, and every .txt file {say(0o644)}.")
        checks = [(f"sh_{i}", f"assert mode({f.path!r}) == 0o755") for i, f in enumerate(sh)]
        checks += [(f"txt_{i}", f"assert mode({f.path!r}) == 0o644") for i, f in enumerate(txt)]
        return Spec(instr, f"chmod 755 {folder}/*.sh\nchmod 644 {folder}/*.txt", checks, sh + txt,
                    params=(folder, tuple(x.path for x in sh)))
    priv = rng.choice(("private", "keys", "secure"))
    keys = [File(f"{priv}/{w}.pem", lines_text([hashlib.sha1(rng.randbytes(8)).hexdigest()]), mode=0o664)
            for w in sorted(rng.sample(WORDS, rng.randint(2, 3)))]
    instr = (f"In /home/user/{folder}, make every .sh file {say(0o755)} and every .txt file {say(0o644)}. Make the "
             f"folder /home/user/{priv} {say(0o700)} and every file in it {say(0o600)}. Finally, write the list of "
             f"the files in /home/user/{priv} (names only, sorted) to /home/user/private_files.txt.")
    sol = (f"chmod 755 {folder}/*.sh\nchmod 644 {folder}/*.txt\nchmod 600 {priv}/*\nchmod 700 {priv}\n"
           f"ls {priv} | sort > private_files.txt")
    checks = [(f"sh_{i}", f"assert mode({f.path!r}) == 0o755") for i, f in enumerate(sh)]
    checks += [(f"txt_{i}", f"assert mode({f.path!r}) == 0o644") for i, f in enumerate(txt)]
    checks += [("private_dir", f"assert mode({priv!r}) == 0o700")]
    checks += [(f"key_{i}", f"assert mode({f.path!r}) == 0o600") for i, f in enumerate(keys)]
    checks += [("listing", f"assert nonblank('private_files.txt') == {[f.path.split('/')[-1] for f in keys]!r}")]
    return Spec(instr, sol, checks, sh + txt + keys, outputs=["private_files.txt"],
                params=(folder, priv, len(keys), sh[0].path))


# --- links --------------------------------------------------------------------------------------------------

@family("links", "links", ("symlink", "hardlink"), held_out=("hardlink",))
def _links(rng, difficulty, variant):
    kind = "a symbolic link" if variant == "symlink" else "a hard link"
    flag = "-s " if variant == "symlink" else ""

    def same(link: str, target: str) -> str:
        if variant == "symlink":
            return (f"assert os.path.islink(HOME / {link!r})\n"
                    f"assert os.path.realpath(HOME / {link!r}) == os.path.realpath(HOME / {target!r})")
        return (f"assert not os.path.islink(HOME / {link!r})\n"
                f"assert os.stat(HOME / {link!r}).st_ino == os.stat(HOME / {target!r}).st_ino")

    versions = sorted(rng.sample(range(1, 30), 3))
    rel = rng.choice(("releases", "builds", "versions"))
    if difficulty == "easy":
        v = versions[-1]
        files = [File(f"{rel}/v{x}/app.txt", lines_text([f"version {x}"])) for x in versions]
        target = f"{rel}/v{v}/app.txt"
        if variant == "symlink":
            instr = f"Create {kind} /home/user/current pointing to the folder /home/user/{rel}/v{v}."
            return Spec(instr, f"ln -s {rel}/v{v} current", [("link", same("current", f"{rel}/v{v}")),
                        ("through_link", f"assert text('current/app.txt') == 'version {v}\\n'")], files,
                        outputs=["current"], params=(rel, v))
        instr = f"Create {kind} /home/user/current.txt to the file /home/user/{target}."
        return Spec(instr, f"ln {target} current.txt", [("link", same("current.txt", target)),
                    ("content", f"assert text('current.txt') == 'version {v}\\n'")], files,
                    outputs=["current.txt"], params=(rel, v))
    tools = sorted(rng.sample(WORDS, rng.randint(2, 4)))
    files = [File(f"tools/{t}.sh", lines_text(["#!/bin/sh", f"echo {t}"]), mode=0o755) for t in tools]
    if difficulty == "medium" or variant == "hardlink":
        instr = (f"For every script /home/user/tools/NAME.sh create {kind} /home/user/bin/NAME (without .sh) to it "
                 "(create /home/user/bin).")
        sol = f"mkdir -p bin\nfor f in tools/*.sh; do n=$(basename \"$f\" .sh); ln {flag}\"$PWD/$f\" bin/$n; done"
        checks = [("bin_dir", "assert (HOME / 'bin').is_dir()")]
        checks += [(f"link_{i}", same(f"bin/{t}", f"tools/{t}.sh")) for i, t in enumerate(tools)]
        checks.append(("no_extra", f"assert sorted(os.listdir(HOME / 'bin')) == {tools!r}"))
        return Spec(instr, sol, checks, files, outputs=["bin"], params=tuple(tools))
    keep = tools[: max(1, len(tools) - 1)]
    links = [File(f"links/{t}", link=f"/home/user/old/{t}.sh") for t in tools]
    instr = ("The symbolic links in /home/user/links point into /home/user/old, which no longer exists. Re-point "
             "each link NAME to /home/user/tools/NAME.sh when that file exists, and delete the links whose script "
             "is not in /home/user/tools. Write the names of the deleted links, sorted, to /home/user/removed.txt "
             "(an empty file when none).")
    sol = ("> removed.txt\nfor l in links/*; do n=$(basename \"$l\"); if [ -f tools/$n.sh ]; then ln -sfn "
           "/home/user/tools/$n.sh \"$l\"; else rm \"$l\"; echo $n >> removed.txt; fi; done\n"
           "sort -o removed.txt removed.txt")
    gone = [t for t in tools if t not in keep]
    checks = [(f"link_{i}", same(f"links/{t}", f"tools/{t}.sh")) for i, t in enumerate(keep)]
    checks += [("removed_links", f"assert sorted(os.listdir(HOME / 'links')) == {keep!r}"),
               ("removed_list", f"assert nonblank('removed.txt') == {gone!r}")]
    return Spec(instr, sol, checks, [f for f in files if f.path.split('/')[-1][:-3] in keep] + links,
                outputs=["removed.txt"], params=tuple(tools))


# --- find by name, size, time -----------------------------------------------------------------------------

@family("find", "find", ("name", "size", "mtime"), held_out=("mtime",))
def _find(rng, difficulty, variant):
    root = rng.choice(("archive", "storage", "work", "media"))
    depth = {"easy": 1, "medium": 3, "hard": 3}[difficulty]
    subdirs = [""] + [f"{rng.choice(WORDS)}/" + ("" if depth < 3 else f"{rng.choice(WORDS)}/") for _ in range(depth)]
    ext = rng.choice(("log", "tmp", "bak", "csv"))
    limit_kb = rng.choice((8, 16, 32))
    cutoff = rng.choice(("2023-01-01", "2023-07-01", "2024-01-01"))
    cut_ts = {"2023-01-01": 1672531200, "2023-07-01": 1688169600, "2024-01-01": 1704067200}[cutoff]
    files, hits, used = [], [], set()
    for i in range(rng.randint(5, 9)):
        name = f"{rng.choice(WORDS)}{i}"
        hit = i < 2 or rng.random() < 0.4
        if variant == "name":
            f = File(f"{root}/{rng.choice(subdirs)}{name}.{ext if hit else rng.choice(('txt', 'md', 'dat'))}",
                     lines_text([sentence(rng)]))
        elif variant == "size":
            size = (limit_kb * 1024 + rng.randint(1, 8000)) if hit else rng.randint(10, limit_kb * 1024 - 1)
            f = File(f"{root}/{rng.choice(subdirs)}{name}.dat", size=size)
        else:
            t = cut_ts - rng.randint(86400, 400 * 86400) if hit else cut_ts + rng.randint(86400, 300 * 86400)
            f = File(f"{root}/{rng.choice(subdirs)}{name}.txt", lines_text([sentence(rng)]), mtime=t)
        if f.path in used:
            continue
        used.add(f.path)
        files.append(f)
        hits += [f.path] if hit else []
    hits.sort()
    crit = {"name": f"whose name ends in `.{ext}`", "size": f"larger than {limit_kb} KiB ({limit_kb * 1024} bytes)",
            "mtime": f"last modified before {cutoff} 00:00 UTC"}[variant]
    test = {"name": f"-name '*.{ext}'", "size": f"-size +{limit_kb * 1024}c",
            "mtime": f"! -newermt '{cutoff} 00:00 UTC'"}[variant]
    absolute = [f"/home/user/{h}" for h in hits]
    if difficulty in ("easy", "medium"):
        instr = (f"Find every file under /home/user/{root} (at any depth) {crit}. Write their absolute paths, "
                 "sorted, one per line, to /home/user/found.txt.")
        return Spec(instr, f"find /home/user/{root} -type f {test} | sort > found.txt",
                    lines_checks("found.txt", absolute), files, outputs=["found.txt"],
                    params=(root, ext if variant == "name" else limit_kb if variant == "size" else cutoff, len(files)))
    dest = rng.choice(("collected", "matches", "picked"))
    instr = (f"Find every file under /home/user/{root} (at any depth) {crit}. Write their absolute paths, sorted, "
             f"one per line, to /home/user/found.txt, then move them into /home/user/{dest} (flat, keeping their "
             f"file names). The other files stay where they are.")
    sol = (f"find /home/user/{root} -type f {test} | sort > found.txt\nmkdir -p {dest}\n"
           f"while read -r p; do mv \"$p\" {dest}/; done < found.txt")
    names = sorted(h.split("/")[-1] for h in hits)
    rest = sorted(f.path for f in files if f.path not in hits)
    checks = lines_checks("found.txt", absolute) + [
        ("moved", f"assert sorted(os.listdir(HOME / {dest!r})) == {names!r}"),
        ("originals_gone", f"assert not any((HOME / p).exists() for p in {hits!r})"),
        ("others_stay", f"assert all((HOME / p).is_file() for p in {rest!r})")]
    return Spec(instr, sol, checks, files, outputs=["found.txt", dest], params=(root, dest, len(files)))


# --- log parsing --------------------------------------------------------------------------------------------

@family("logs", "logs", ("access", "app"), held_out=("app",))
def _logs(rng, difficulty, variant):
    n = rng.randint(20, 40)
    if variant == "access":
        ips = [f"10.0.{rng.randint(0, 3)}.{rng.randint(1, 40)}" for _ in range(rng.randint(3, 7))]
        weights = list(range(len(PATHS), 0, -1))
        rng.shuffle(weights)
        recs = [(rng.choice(ips), rng.choices(PATHS, weights)[0], rng.choice((200, 200, 200, 301, 404, 500)))
                for _ in range(n)]
        text = lines_text(f'{ip} - - [12/Mar/2024:10:{i % 60:02d}:00 +0000] "GET {p} HTTP/1.1" '
                          f'{s} {rng.randint(100, 9000)}'
                          for i, (ip, p, s) in enumerate(recs))
        f = File("logs/access.log", text)
        code = rng.choice((404, 500, 301))
        if difficulty == "easy":
            instr = (f"Count the requests in /home/user/logs/access.log that got status {code}; "
                     "write the number to /home/user/answer.txt.")
            return Spec(instr, f"awk '$9 == {code}' logs/access.log | wc -l > answer.txt",
                        answer_checks("answer.txt", sum(r[2] == code for r in recs)), [f], outputs=["answer.txt"],
                        params=(code, n))
        if difficulty == "medium":
            want = sorted({r[0] for r in recs})
            instr = ("Write the distinct client IP addresses in /home/user/logs/access.log (first field), sorted, "
                     "one per line, to /home/user/ips.txt.")
            return Spec(instr, "cut -d' ' -f1 logs/access.log | sort -u > ips.txt",
                        lines_checks("ips.txt", want, ordered=False),
                        [f], outputs=["ips.txt"], params=(len(ips), n))
        counts = collections.Counter(r[1] for r in recs)
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        want = [f"{c} {p}" for p, c in top]
        instr = ("From /home/user/logs/access.log, write the 3 most requested paths to /home/user/top.txt, one per "
                 "line as `COUNT PATH`, most requested first; equal counts are ordered by path. Also write the "
                 f"number of requests with status {code} to /home/user/errors.txt.")
        sol = ("awk '{print $7}' logs/access.log | sort | uniq -c | sort -k1,1nr -k2,2 | head -n 3 "
               "| awk '{print $1\" \"$2}' > top.txt\n"
               f"awk '$9 == {code}' logs/access.log | wc -l > errors.txt")
        checks = lines_checks("top.txt", want) + [
            ("errors", f"assert text('errors.txt').strip() == '{sum(r[2] == code for r in recs)}'")]
        return Spec(instr, sol, checks, [f], outputs=["top.txt", "errors.txt"], params=(code, n))
    recs = [(rng.choice(LEVELS), rng.choice(COMPONENTS)) for _ in range(n)]
    text = lines_text(f"2024-03-{1 + i // 24:02d}T{i % 24:02d}:00:00Z {lv} {c}: {sentence(rng, 2, 5)}"
                      for i, (lv, c) in enumerate(recs))
    f = File("logs/app.log", text)
    lv = rng.choice(("ERROR", "WARN"))
    if difficulty == "easy":
        instr = (f"Count the {lv} lines (second field) in /home/user/logs/app.log; "
                 "write the number to /home/user/answer.txt.")
        return Spec(instr, f"awk '$2 == \"{lv}\"' logs/app.log | wc -l > answer.txt",
                    answer_checks("answer.txt", sum(r[0] == lv for r in recs)), [f], outputs=["answer.txt"],
                    params=(lv, n))
    if difficulty == "medium":
        want = sorted({r[1] for r in recs if r[0] == lv})
        instr = (f"Write the distinct components (third field, without the trailing colon) that logged a {lv} line in "
                 "/home/user/logs/app.log, sorted, one per line, to /home/user/components.txt.")
        return Spec(instr,
                    f"awk '$2 == \"{lv}\" {{sub(\":\", \"\", $3); print $3}}' logs/app.log | sort -u > components.txt",
                    lines_checks("components.txt", want), [f], outputs=["components.txt"], params=(lv, n))
    counts = collections.Counter(r[0] for r in recs)
    want = [f"{k} {counts[k]}" for k in sorted(counts)]
    instr = ("Write one line per log level found in /home/user/logs/app.log (second field) as `LEVEL COUNT`, "
             f"sorted by level name, to /home/user/levels.txt. Also copy every {lv} line, in order, "
             f"to /home/user/{lv.lower()}.log.")
    sol = (f"awk '{{print $2}}' logs/app.log | sort | uniq -c | awk '{{print $2\" \"$1}}' > levels.txt\n"
           f"awk '$2 == \"{lv}\"' logs/app.log > {lv.lower()}.log")
    sel = [ln for ln in text.splitlines() if ln.split()[1] == lv]
    checks = lines_checks("levels.txt", want) + [("selected", f"assert nonblank({lv.lower() + '.log'!r}) == {sel!r}")]
    return Spec(instr, sol, checks, [f], outputs=["levels.txt", f"{lv.lower()}.log"], params=(lv, n))


# --- sorting and de-duplication ---------------------------------------------------------------------------

@family("sort", "sorting", ("alpha", "numeric"))
def _sort(rng, difficulty, variant):
    src = rng.choice(("list.txt", "items.txt", "entries.txt"))
    if difficulty == "hard":
        names = rng.sample(NAMES, rng.randint(5, 9))
        recs = [(n, rng.randint(1, 999)) for n in names for _ in range(rng.randint(1, 3))]
        rng.shuffle(recs)
        f = File(src, lines_text(f"{n} {s}" for n, s in recs))
        best = {}
        for n, s in recs:
            best[n] = max(best.get(n, 0), s)
        order = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))
        want = [f"{n} {s}" for n, s in order]
        instr = (f"Each line of /home/user/{src} is `NAME SCORE`. Keep only the highest score of each name and write "
                 "`NAME SCORE` lines to /home/user/ranked.txt, highest score first (equal scores by name). Write "
                 "the number of distinct names to /home/user/count.txt.")
        sol = (f"sort -k1,1 -k2,2nr {src} | awk '!seen[$1]++' | sort -k2,2nr -k1,1 > ranked.txt\n"
               "wc -l < ranked.txt > count.txt")
        checks = lines_checks("ranked.txt", want) + [("count", f"assert text('count.txt').strip() == '{len(best)}'"),
                                                     unchanged(src, f.text)]
        return Spec(instr, sol, checks, [f], outputs=["ranked.txt", "count.txt"], params=(src, len(names), len(recs)))
    if variant == "alpha":
        vals = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
        key, flag = (lambda v: v), ""
    else:
        vals = [str(rng.randint(1, 5000)) for _ in range(rng.randint(8, 16))]
        key, flag = int, "n"
    vals += rng.sample(vals, 3)  # duplicates
    rng.shuffle(vals)
    f = File(src, lines_text(vals))
    order = "alphabetically" if variant == "alpha" else "numerically (ascending)"
    if difficulty == "easy":
        want = sorted(vals, key=key)
        return Spec(f"Sort the lines of /home/user/{src} {order} and write them to /home/user/sorted.txt.",
                    f"sort{' -n' if flag else ''} {src} > sorted.txt",
                    lines_checks("sorted.txt", want) + [unchanged(src, f.text)],
                    [f], outputs=["sorted.txt"], params=(src, len(vals)))
    want = sorted(set(vals), key=key)
    dups = sorted({v for v in vals if vals.count(v) > 1}, key=key)
    instr = (f"Write the distinct lines of /home/user/{src}, sorted {order}, to /home/user/unique.txt, and the lines "
             "that occur more than once (each once, same order) to /home/user/duplicates.txt.")
    sol = f"sort -u{flag} {src} > unique.txt\nsort{' -n' if flag else ''} {src} | uniq -d > duplicates.txt"
    checks = lines_checks("unique.txt", want) + [("duplicates", f"assert nonblank('duplicates.txt') == {dups!r}")]
    return Spec(instr, sol, checks, [f], outputs=["unique.txt", "duplicates.txt"], params=(src, len(vals), len(dups)))


# --- config editing ---------------------------------------------------------------------------------------

@family("config", "config", ("ini", "env"))
def _config(rng, difficulty, variant):
    keys = rng.sample(("port", "host", "workers", "timeout", "log_level", "cache_size", "retries", "mode"), 5)
    vals = {k: str(rng.randint(1, 9000)) if k in ("port", "workers", "timeout", "cache_size", "retries")
            else rng.choice(WORDS) for k in keys}
    if variant == "env":
        up = {k: k.upper() for k in keys}
        f = File(".env", lines_text([f"# settings for {rng.choice(WORDS)}"] + [f"{up[k]}={vals[k]}" for k in keys]))
        k1, k2 = keys[0], keys[1]
        v1 = str(int(vals[k1]) + 1) if vals[k1].isdigit() else rng.choice([w for w in WORDS if w != vals[k1]])
        v2 = rng.choice(NAMES)
        new_key = rng.choice(("DEBUG", "REGION", "OWNER"))
        if difficulty == "easy":
            want = f.text.replace(f"{up[k1]}={vals[k1]}\n", f"{up[k1]}={v1}\n")
            return Spec(f"In /home/user/.env, set {up[k1]} to `{v1}`, changing nothing else.",
                        f"sed -i 's/^{up[k1]}=.*/{up[k1]}={v1}/' .env",
                        [("value", f"assert f'{up[k1]}={v1}' in nonblank('.env')"),
                         ("exact", f"assert text('.env') == {want!r}")],
                        [f], params=(k1, v1))
        want = (f.text.replace(f"{up[k1]}={vals[k1]}\n", f"{up[k1]}={v1}\n")
                .replace(f"{up[k2]}={vals[k2]}\n", f"{up[k2]}={v2}\n"))
        extra = f"{new_key}={rng.choice(WORDS)}"
        dropped = keys[2] if difficulty == "hard" else None
        if dropped:
            want = want.replace(f"{up[dropped]}={vals[dropped]}\n", "")
        want += extra + "\n"
        instr = (f"In /home/user/.env set {up[k1]} to `{v1}` and {up[k2]} to `{v2}`, "
                 + (f"delete the {up[dropped]} line, " if dropped else "")
                 + f"and append the line `{extra}`. Keep everything else.")
        sol = (f"sed -i -e 's/^{up[k1]}=.*/{up[k1]}={v1}/' -e 's/^{up[k2]}=.*/{up[k2]}={v2}/' .env\n"
               + (f"sed -i '/^{up[dropped]}=/d' .env\n" if dropped else "") + f"echo '{extra}' >> .env")
        checks = [("first", f"assert f'{up[k1]}={v1}' in nonblank('.env')"),
                  ("second", f"assert f'{up[k2]}={v2}' in nonblank('.env')"),
                  ("appended", f"assert nonblank('.env')[-1] == {extra!r}"),
                  ("exact", f"assert text('.env') == {want!r}")]
        return Spec(instr, sol, checks, [f], params=(k1, k2, difficulty))
    sections = ("server", "client")
    lines = []
    for s in sections:
        lines += [f"[{s}]"] + [f"{k} = {vals[k] if s == 'server' else vals[k] + ('0' if vals[k].isdigit() else 'x')}"
                               for k in keys] + [""]
    f = File("app.ini", lines_text(lines[:-1]))
    k = keys[0]
    newv = rng.choice([w for w in WORDS if w != vals[k]]) if not vals[k].isdigit() else str(int(vals[k]) * 2 + 1)
    sec = rng.choice(sections)
    old_line = [ln for ln in lines if ln.startswith(f"{k} = ")][sections.index(sec)]
    idx = lines.index(old_line)
    new_lines = list(lines[:-1])
    new_lines[idx] = f"{k} = {newv}"
    if difficulty == "easy":
        instr = (f"In /home/user/app.ini, set `{k}` in the [{sec}] section to `{newv}`; "
                 "the other sections stay as they are.")
        rng_ = "/^\\[server\\]/,/^$/" if sec == "server" else "/^\\[client\\]/,$"
        sol = f"sed -i '{rng_} s/^{k} = .*/{k} = {newv}/' app.ini"
        return Spec(instr, sol, [("value", f"assert {new_lines[idx]!r} in nonblank('app.ini')"),
                                 ("exact", f"assert text('app.ini') == {lines_text(new_lines)!r}")],
                    [f], params=(k, sec, newv))
    k2 = keys[1]
    c_line = [i for i, ln in enumerate(new_lines) if ln.startswith(f"{k2} = ")][sections.index(sec)]
    new_lines[c_line] = "# " + new_lines[c_line]
    add = f"owner = {rng.choice(NAMES)}"
    end = new_lines.index("") if sec == "server" else len(new_lines)
    new_lines.insert(end, add)
    if difficulty == "hard":
        new_lines = new_lines + ["", "[logging]", "level = info"]
    instr = (f"In /home/user/app.ini, in the [{sec}] section only: set `{k}` to `{newv}`, comment out the `{k2}` line "
             f"(prefix it with `# `), and add the line `{add}` as the section's last line."
             + (" Then append a new section `[logging]` with the line `level = info`, separated by one blank line."
                if difficulty == "hard" else ""))
    sol = ("python3 - <<'PY'\nlines = open('app.ini').read().split('\\n')[:-1]\nsec = None\nout = []\n"
           "for ln in lines:\n    if ln.startswith('['):\n        sec = ln.strip('[]')\n"
           f"    if sec == {sec!r} and ln.startswith({k + ' = '!r}):\n        ln = {k + ' = ' + newv!r}\n"
           f"    if sec == {sec!r} and ln.startswith({k2 + ' = '!r}):\n        ln = '# ' + ln\n"
           "    out.append(ln)\n"
           f"if {sec!r} == 'server':\n    out.insert(out.index(''), {add!r})\nelse:\n    out.append({add!r})\n"
           + ("out += ['', '[logging]', 'level = info']\n" if difficulty == "hard" else "")
           + "open('app.ini', 'w').write('\\n'.join(out) + '\\n')\nPY")
    checks = [("value", f"assert {k + ' = ' + newv!r} in nonblank('app.ini')"),
              ("commented", f"assert {'# ' + k2 + ' = '!r} in text('app.ini')"),
              ("added", f"assert {add!r} in nonblank('app.ini')"),
              ("exact", f"assert text('app.ini') == {lines_text(new_lines)!r}")]
    return Spec(instr, sol, checks, [f], params=(k, k2, sec, difficulty))


# --- small scripts ----------------------------------------------------------------------------------------

@family("script", "scripting", ("bash", "python"), held_out=("python",))
def _script(rng, difficulty, variant):
    name = rng.choice(("tool", "helper", "util", "run"))
    path = f"bin/{name}.sh" if variant == "bash" else f"bin/{name}.py"
    lang = "a bash script" if variant == "bash" else "a Python 3 script (with a `#!/usr/bin/env python3` line)"
    runner = "['bash', str(HOME / %r)]" % path if variant == "bash" else "['python3', str(HOME / %r)]" % path
    run = (f"def run(*args):\n"
           f"    return subprocess.run({runner} + list(args), capture_output=True, text=True, timeout=20)\n")
    common = [("exists", f"assert (HOME / {path!r}).is_file()"), ("executable", f"assert mode({path!r}) & 0o100")]
    greet = rng.choice(("Hello", "Hi", "Welcome", "Greetings"))
    if difficulty == "easy":
        instr = (f"Write {lang} /home/user/{path}, executable, that prints `{greet}, NAME!` where NAME is its first "
                 "argument.")
        body = f"#!/bin/bash\necho \"{greet}, $1!\"" if variant == "bash" else \
            f"#!/usr/bin/env python3\nimport sys\nprint(f'{greet}, {{sys.argv[1]}}!')"
        names = rng.sample(NAMES, 2)
        checks = common + [(f"greets_{i}", run + f"assert run({n!r}).stdout.strip() == '{greet}, {n}!'")
                           for i, n in enumerate(names)]
        return Spec(instr, f"mkdir -p bin\ncat > {path} <<'EOF'\n{body}\nEOF\nchmod +x {path}", checks, [],
                    outputs=[path], params=(name, greet, tuple(names)))
    if difficulty == "medium":
        instr = (f"Write {lang} /home/user/{path}, executable, that takes a file path and prints the number of "
                 "non-empty lines in that file (just the number).")
        body = "#!/bin/bash\ngrep -c . \"$1\"" if variant == "bash" else \
            "#!/usr/bin/env python3\nimport sys\nprint(sum(1 for l in open(sys.argv[1]) if l.strip()))"
        cases = [(rng.randint(1, 6), rng.randint(0, 3)) for _ in range(2)]
        checks = common + [(f"counts_{i}", run + f"import tempfile\n"
                            f"with tempfile.NamedTemporaryFile('w', suffix='.txt', delete=False) as f:\n"
                            f"    f.write('x\\n' * {a} + '\\n' * {b} + 'y\\n')\n"
                            f"assert run(f.name).stdout.strip() == '{a + 1}'")
                           for i, (a, b) in enumerate(cases)]
        return Spec(instr, f"mkdir -p bin\ncat > {path} <<'EOF'\n{body}\nEOF\nchmod +x {path}", checks, [],
                    outputs=[path], params=(name, tuple(cases)))
    instr = (f"Write {lang} /home/user/{path}, executable, that takes a folder path and prints, for each file "
             "extension found directly in that folder (files only, the part after the last dot; files without a "
             "dot count as `none`), a line `EXT COUNT`, sorted by extension. Then run it on /home/user/inbox and "
             "save its output to /home/user/extensions.txt.")
    files = [File(f"inbox/{rng.choice(WORDS)}{i}{rng.choice(('.txt', '.csv', '.md', '.py', ''))}", lines_text(["x"]))
             for i in range(rng.randint(4, 9))]
    exts = collections.Counter(f.path.rsplit(".", 1)[1] if "." in f.path.split("/")[-1] else "none" for f in files)
    want = [f"{e} {c}" for e, c in sorted(exts.items())]
    body = ("#!/bin/bash\nfor f in \"$1\"/*; do [ -f \"$f\" ] || continue; b=$(basename \"$f\"); "
            "case \"$b\" in *.*) echo \"${b##*.}\";; "
            "*) echo none;; esac; done | sort | uniq -c | awk '{print $2\" \"$1}'") if variant == "bash" else \
        ("#!/usr/bin/env python3\nimport collections, os, sys\nc = collections.Counter()\n"
         "for n in os.listdir(sys.argv[1]):\n"
         "    if os.path.isfile(os.path.join(sys.argv[1], n)):\n"
         "        c[n.rsplit('.', 1)[1] if '.' in n else 'none'] += 1\n"
         "for e in sorted(c):\n    print(e, c[e])")
    checks = common + [("output_file", f"assert nonblank('extensions.txt') == {want!r}"),
                       ("fresh_folder", run + "import tempfile\nd = tempfile.mkdtemp()\n"
                                              "for n in ('a.x', 'b.x', 'c'):\n"
                                              "    open(os.path.join(d, n), 'w').close()\n"
                                              "os.mkdir(os.path.join(d, 'sub.x'))\n"
                                              "assert run(d).stdout.split('\\n')[:2] == ['none 1', 'x 2']")]
    return Spec(instr, f"mkdir -p bin\ncat > {path} <<'EOF'\n{body}\nEOF\nchmod +x {path}\n"
                       f"./{path} inbox > extensions.txt",
                checks, files, outputs=[path, "extensions.txt"], params=(name, tuple(want)))


# --- checksums --------------------------------------------------------------------------------------------

@family("checksum", "checksums", ("sha256", "md5"), held_out=("md5",))
def _checksum(rng, difficulty, variant):
    tool = f"{variant}sum"
    h = (lambda b: hashlib.sha256(b).hexdigest()) if variant == "sha256" else (lambda b: hashlib.md5(b).hexdigest())
    folder = rng.choice(("downloads", "payload", "dist", "release"))
    files = [File(f"{folder}/{w}.bin", lines_text(sentence(rng) for _ in range(rng.randint(1, 4))))
             for w in sorted(rng.sample(WORDS, rng.randint(2, 5)))]
    if difficulty == "easy":
        f = files[0]
        instr = (f"Write the {variant.upper()} checksum (hex digest only) of /home/user/{f.path} "
                 "to /home/user/checksum.txt.")
        return Spec(instr, f"{tool} {f.path} | cut -d' ' -f1 > checksum.txt",
                    answer_checks("checksum.txt", h(f.text.encode())), files[:1], outputs=["checksum.txt"],
                    params=(folder, files[0].path))
    manifest = "SHA256SUMS" if variant == "sha256" else "MD5SUMS"
    if difficulty == "medium":
        want = [f"{h(f.text.encode())}  {f.path.split('/')[-1]}" for f in files]
        instr = (f"Write /home/user/{folder}/{manifest} in `{tool}` format (`DIGEST  NAME`, two spaces, names without "
                 f"folder) for every .bin file in /home/user/{folder}, sorted by name.")
        return Spec(instr, f"cd {folder} && {tool} *.bin > {manifest}", lines_checks(f"{folder}/{manifest}", want),
                    files, outputs=[f"{folder}/{manifest}"], params=(folder, files[0].path, len(files)))
    bad = sorted(rng.sample([f.path.split("/")[-1] for f in files], rng.randint(1, max(1, len(files) - 1))))
    man = File(f"{folder}/{manifest}",
               lines_text(f"{h((f.text + ('x' if f.path.split('/')[-1] in bad else '')).encode())}  "
                          f"{f.path.split('/')[-1]}" for f in files))
    instr = (f"/home/user/{folder}/{manifest} lists the expected {variant.upper()} checksums of the .bin files next "
             f"to it. Write the names of the files whose checksum does not match, sorted, to /home/user/corrupted.txt, "
             "and move those files into /home/user/quarantine.")
    sol = (f"cd {folder}\n"
           f"{tool} -c {manifest} 2>/dev/null | grep ': FAILED$' | cut -d: -f1 | sort > ../corrupted.txt || true\n"
           "cd ..\nmkdir -p quarantine\nwhile read -r n; do mv \"" + folder + "/$n\" quarantine/; done < corrupted.txt")
    good = [f.path for f in files if f.path.split("/")[-1] not in bad]
    checks = [("corrupted_list", f"assert nonblank('corrupted.txt') == {bad!r}"),
              ("quarantined", f"assert sorted(os.listdir(HOME / 'quarantine')) == {bad!r}"),
              ("good_stay", f"assert all((HOME / p).is_file() for p in {good!r})")]
    return Spec(instr, sol, checks, files + [man], outputs=["corrupted.txt", "quarantine"], params=(folder, tuple(bad)))


# --- text extraction --------------------------------------------------------------------------------------

@family("extract", "text", ("head", "tail"))
def _extract(rng, difficulty, variant):
    src = rng.choice(("journal.txt", "notes.md", "book.txt", "story.txt"))
    body = [sentence(rng) for _ in range(rng.randint(12, 24))]
    if difficulty == "easy":
        k = rng.randint(2, 6)
        f = File(src, lines_text(body))
        want = body[:k] if variant == "head" else body[-k:]
        where = "first" if variant == "head" else "last"
        return Spec(f"Write the {where} {k} lines of /home/user/{src} to /home/user/excerpt.txt.",
                    f"{variant} -n {k} {src} > excerpt.txt", lines_checks("excerpt.txt", want), [f],
                    outputs=["excerpt.txt"], params=(src, k, len(body)))
    if difficulty == "medium":
        a = rng.randint(1, 4)
        b = a + rng.randint(2, 5)
        start, end = rng.choice((("BEGIN", "END"), ("START", "STOP"), (">>>", "<<<")))
        lines = body[:a] + [start] + body[a:b] + [end] + body[b:]
        f = File(src, lines_text(lines))
        instr = (f"/home/user/{src} contains a line `{start}` and later a line `{end}`. Write the lines between them "
                 "(not the markers) to /home/user/section.txt.")
        sol = f"awk '$0 == \"{end}\" {{p = 0}} p {{print}} $0 == \"{start}\" {{p = 1}}' {src} > section.txt"
        return Spec(instr, sol, lines_checks("section.txt", body[a:b]), [f], outputs=["section.txt"],
                    params=(src, start, a, b))
    folder = rng.choice(("notes", "todo", "src"))
    tag = rng.choice(("TODO", "FIXME", "XXX"))
    files, want = [], []
    for w in sorted(rng.sample(WORDS, rng.randint(2, 4))):
        ls = [sentence(rng) for _ in range(rng.randint(4, 9))]
        for _ in range(rng.randint(1, 2)):
            ls.insert(rng.randrange(len(ls) + 1), f"{tag}: {sentence(rng, 2, 4)}")
        files.append(File(f"{folder}/{w}.txt", lines_text(ls)))
        want += [f"{w}.txt:{i + 1}:{ln}" for i, ln in enumerate(ls) if tag in ln]
    instr = (f"Collect every line containing `{tag}` from the .txt files in /home/user/{folder} into "
             f"/home/user/{tag.lower()}s.txt as `FILE:LINE:TEXT` (file name without folder, 1-based line number), "
             "ordered by file name and then line number. Write the number of such lines to /home/user/count.txt.")
    sol = f"cd {folder} && grep -n {tag} *.txt > ../{tag.lower()}s.txt; cd .. && wc -l < {tag.lower()}s.txt > count.txt"
    checks = lines_checks(f"{tag.lower()}s.txt", want) + [
        ("count", f"assert text('count.txt').strip() == '{len(want)}'")]
    return Spec(instr, sol, checks, files, outputs=[f"{tag.lower()}s.txt", "count.txt"],
                params=(folder, tag, len(want)))


# --- renaming ---------------------------------------------------------------------------------------------

@family("rename", "files", ("extension", "prefix"), held_out=("prefix",))
def _rename(rng, difficulty, variant):
    folder = rng.choice(("photos", "papers", "drafts", "exports"))
    if difficulty == "easy":
        a, b = rng.sample(WORDS, 2)
        f = File(f"{folder}/{a}.txt", lines_text([sentence(rng)]))
        return Spec(f"Rename /home/user/{folder}/{a}.txt to /home/user/{folder}/{b}.txt.",
                    f"mv {folder}/{a}.txt {folder}/{b}.txt",
                    [("new_name", f"assert text('{folder}/{b}.txt') == {f.text!r}"),
                     ("old_gone", f"assert not (HOME / '{folder}/{a}.txt').exists()")],
                    [f], params=(folder, a, b))
    names = sorted(rng.sample(WORDS, rng.randint(3, 6)))
    if difficulty == "medium":
        files = [File(f"{folder}/{n}.txt", lines_text([sentence(rng)])) for n in names]
        keep = File(f"{folder}/index.html", lines_text(["<html></html>"]))
        if variant == "extension":
            new = rng.choice(("md", "text", "log"))
            instr = f"In /home/user/{folder}, change the extension of every .txt file to .{new}; other files stay."
            sol = f"for f in {folder}/*.txt; do mv \"$f\" \"${{f%.txt}}.{new}\"; done"
            want = sorted([f"{n}.{new}" for n in names] + ["index.html"])
        else:
            new = rng.choice(("2024_", "old_", "final_"))
            instr = f"In /home/user/{folder}, add the prefix `{new}` to the name of every .txt file; other files stay."
            sol = f"cd {folder} && for f in *.txt; do mv \"$f\" \"{new}$f\"; done"
            want = sorted([f"{new}{n}.txt" for n in names] + ["index.html"])
        renamed = f"{folder}/{names[0]}.{new}" if variant == "extension" else f"{folder}/{new}{names[0]}.txt"
        checks = [("names", f"assert sorted(os.listdir(HOME / {folder!r})) == {want!r}"),
                  ("content_kept", f"assert text({renamed!r}) == {files[0].text!r}"),
                  unchanged(keep.path, keep.text, "other_unchanged")]
        return Spec(instr, sol, checks, files + [keep], params=(folder, new, tuple(names)))
    raw = [f"{n.capitalize()} {rng.choice(WORDS).upper()} {i}.TXT" for i, n in enumerate(names)]
    files = [File(f"{folder}/{r}", lines_text([sentence(rng)])) for r in raw]
    want = sorted(r.lower().replace(" ", "_") for r in raw)
    instr = (f"In /home/user/{folder}, rename every file so its name is all lower case with spaces replaced by "
             "underscores (e.g. `My File.TXT` becomes `my_file.txt`). Then write the new names, sorted, to "
             "/home/user/renamed.txt.")
    sol = (f"cd {folder} && for f in *; do n=$(echo \"$f\" | tr 'A-Z ' 'a-z_'); "
           f"[ \"$f\" = \"$n\" ] || mv \"$f\" \"$n\"; done\n"
           "ls | sort > ../renamed.txt")
    checks = [("names", f"assert sorted(os.listdir(HOME / {folder!r})) == {want!r}"),
              ("content_kept",
               f"assert text({folder + '/' + raw[0].lower().replace(' ', '_')!r}) == {files[0].text!r}"),
              ("listing", f"assert nonblank('renamed.txt') == {want!r}")]
    return Spec(instr, sol, checks, files, outputs=["renamed.txt"], params=(folder, tuple(names)))


# --- files and directories --------------------------------------------------------------------------------

@family("layout", "files", ("project", "backup"))
def _layout(rng, difficulty, variant):
    root = rng.choice(("app", "service", "lib", "site"))
    subs = sorted(rng.sample(("src", "tests", "docs", "assets", "config", "scripts"), 3))
    if difficulty == "easy":
        instr = "Create the folders " + ", ".join(f"/home/user/{root}/{s}" for s in subs) + "."
        return Spec(instr, "mkdir -p " + " ".join(f"{root}/{s}" for s in subs),
                    [(f"dir_{i}", f"assert (HOME / {root + '/' + s!r}).is_dir()") for i, s in enumerate(subs)],
                    [], outputs=[root], params=(root, tuple(subs)))
    loose = [File(f"inbox/{rng.choice(WORDS)}{i}.{e}", lines_text([sentence(rng)])) for i, e in
             enumerate(rng.choices(("py", "md", "json"), k=rng.randint(4, 7)))]
    where = {"py": "src", "md": "docs", "json": "config"}
    if variant == "backup":
        stamp = rng.choice(("2024-01-15", "2024-06-30", "2023-12-31"))
        instr = (f"Copy every file of /home/user/inbox into /home/user/backup-{stamp}/ (keep the originals), then "
                 f"write the number of copied files to /home/user/backup-{stamp}/COUNT.")
        sol = f"mkdir -p backup-{stamp}\ncp inbox/* backup-{stamp}/\nls inbox | wc -l > backup-{stamp}/COUNT"
        checks = [(f"copy_{i}", f"assert text('backup-{stamp}/{f.path.split('/')[1]}') == {f.text!r}")
                  for i, f in enumerate(loose)]
        checks += [("originals", f"assert len(os.listdir(HOME / 'inbox')) == {len(loose)}"),
                   ("count", f"assert text('backup-{stamp}/COUNT').strip() == '{len(loose)}'")]
        if difficulty == "hard":
            instr += " Finally make the backup folder and its files read-only for everyone (folder 555, files 444)."
            sol += f"\nchmod 444 backup-{stamp}/*\nchmod 555 backup-{stamp}"
            checks += [("dir_mode", f"assert mode('backup-{stamp}') == 0o555"),
                       ("file_modes", f"assert all(mode('backup-{stamp}/' + n) == 0o444 "
                                      f"for n in os.listdir(HOME / 'backup-{stamp}'))")]
        return Spec(instr, sol, checks, loose, outputs=[f"backup-{stamp}"],
                    params=(stamp, tuple(f.path for f in loose)))
    instr = (f"Sort the files of /home/user/inbox into /home/user/{root}: .py files into {root}/src, .md files into "
             f"{root}/docs, .json files into {root}/config (create the folders; move, do not copy).")
    sol = f"mkdir -p {root}/src {root}/docs {root}/config\nmv inbox/*.py {root}/src/ 2>/dev/null || true\n" \
          f"mv inbox/*.md {root}/docs/ 2>/dev/null || true\nmv inbox/*.json {root}/config/ 2>/dev/null || true"
    checks = [(f"moved_{i}",
               f"assert text('{root}/{where[f.path.rsplit('.', 1)[1]]}/{f.path.split('/')[1]}') == {f.text!r}")
              for i, f in enumerate(loose)]
    checks.append(("inbox_empty", "assert os.listdir(HOME / 'inbox') == []"))
    if difficulty == "hard":
        instr += (f" Then write /home/user/{root}/MANIFEST listing every moved file as `FOLDER/NAME` relative to "
                  f"{root}, sorted.")
        sol += f"\ncd {root} && find src docs config -type f | sort > MANIFEST"
        want = sorted(f"{where[f.path.rsplit('.', 1)[1]]}/{f.path.split('/')[1]}" for f in loose)
        checks.append(("manifest", f"assert nonblank('{root}/MANIFEST') == {want!r}"))
    return Spec(instr, sol, checks, loose, dirs=["inbox"], outputs=[root], params=(root, tuple(f.path for f in loose)))


# --- merging and joining ------------------------------------------------------------------------------------

@family("merge", "text", ("concat", "join"), held_out=("join",))
def _merge(rng, difficulty, variant):
    folder = rng.choice(("parts", "chunks", "pieces"))
    if variant == "concat":
        n = {"easy": 2, "medium": rng.randint(3, 5), "hard": rng.randint(3, 5)}[difficulty]
        parts = [File(f"{folder}/part{i + 1:02d}.txt", lines_text(sentence(rng) for _ in range(rng.randint(1, 4))))
                 for i in range(n)]
        whole = "".join(p.text for p in parts)
        if difficulty == "hard":
            instr = (f"Concatenate the files {folder}/part*.txt in /home/user in name order into /home/user/whole.txt, "
                     "then write the number of lines of whole.txt to /home/user/lines.txt and delete the folder "
                     f"/home/user/{folder}.")
            sol = f"cat {folder}/part*.txt > whole.txt\nwc -l < whole.txt > lines.txt\nrm -r {folder}"
            checks = [("whole", f"assert text('whole.txt') == {whole!r}"),
                      ("lines", f"assert text('lines.txt').strip() == '{whole.count(chr(10))}'"),
                      ("folder_gone", f"assert not (HOME / {folder!r}).exists()")]
            return Spec(instr, sol, checks, parts, outputs=["whole.txt", "lines.txt"],
                        params=(folder, n, whole.count(chr(10))))
        instr = f"Concatenate /home/user/{folder}/part*.txt in name order into /home/user/whole.txt."
        return Spec(instr, f"cat {folder}/part*.txt > whole.txt", [("exists", "assert (HOME / 'whole.txt').is_file()"),
                    ("whole", f"assert text('whole.txt') == {whole!r}")], parts, outputs=["whole.txt"],
                    params=(folder, n, whole.count(chr(10))))
    ids = rng.sample(NAMES, rng.randint(4, 8))
    emails = {i: f"{i}@{rng.choice(WORDS)}.org" for i in ids}
    cities = {i: rng.choice(WORDS).capitalize() for i in ids if rng.random() < 0.8 or i == ids[0]}
    a = File(f"{folder}/emails.txt", lines_text(f"{i} {emails[i]}" for i in sorted(ids)))
    b = File(f"{folder}/cities.txt", lines_text(f"{i} {cities[i]}" for i in sorted(cities)))
    want = [f"{i} {emails[i]} {cities[i]}" for i in sorted(cities)]
    instr = (f"/home/user/{folder}/emails.txt has `NAME EMAIL` lines and /home/user/{folder}/cities.txt `NAME CITY` "
             "lines, both sorted by name. Write `NAME EMAIL CITY` for every name present in both "
             "to /home/user/joined.txt, sorted by name.")
    sol = f"join {folder}/emails.txt {folder}/cities.txt > joined.txt"
    checks = lines_checks("joined.txt", want)
    if difficulty == "hard":
        missing = sorted(set(ids) - set(cities))
        instr += (" Write the names that have an email but no city, sorted, to /home/user/missing.txt "
                  "(empty file if none).")
        sol += f"\njoin -v 1 {folder}/emails.txt {folder}/cities.txt | cut -d' ' -f1 > missing.txt"
        checks.append(("missing", f"assert nonblank('missing.txt') == {missing!r}"))
    return Spec(instr, sol, checks, [a, b], outputs=["joined.txt"], params=(folder, tuple(sorted(ids))))


# --- basic file operations ---------------------------------------------------------------------------------
# One shell command per step with every path spelled out: the tier a ~100M-parameter model can sometimes solve
# (the CPU default's calibration, docs/cpu_default.md). Medium and hard chain two and three such steps.

BASIC_OPS = ("mkdir", "touch", "write", "copy", "move", "remove")


def _basic_step(rng, op: str, taken: set) -> tuple[str, str, list, list[File], list[str], list[str], tuple]:
    """(instruction sentence, solution line, checks, starting files, starting folders, outputs, params) of one
    step; outputs are the paths the step creates (they must not exist before)."""
    def fresh(ext: str = "") -> str:
        name = rng.choice([w for w in WORDS if w not in taken])
        taken.add(name)
        return name + ext

    if op == "mkdir":
        d = fresh()
        return (f"Create the directory /home/user/{d}.", f"mkdir {d}",
                [(f"{d}_is_dir", f"assert (HOME / {d!r}).is_dir()"),
                 (f"{d}_is_empty", f"assert os.listdir(HOME / {d!r}) == []")],
                [], [], [d], (op, d))
    if op == "touch":
        f = fresh(".txt")
        return (f"Create an empty file /home/user/{f}.", f"touch {f}",
                [(f"{f[:-4]}_is_file", f"assert (HOME / {f!r}).is_file()"),
                 (f"{f[:-4]}_is_empty", f"assert text({f!r}) == ''")],
                [], [], [f], (op, f))
    if op == "write":
        f, word = fresh(".txt"), rng.choice(WORDS)
        return (f"Write the word {word} to the file /home/user/{f}.", f"echo {word} > {f}",
                [(f"{f[:-4]}_is_file", f"assert (HOME / {f!r}).is_file()"),
                 (f"{f[:-4]}_has_word", f"assert text({f!r}).strip() == {word!r}")],
                [], [], [f], (op, f, word))
    src = File(fresh(".log" if op == "remove" else ".txt"), lines_text([sentence(rng)]))
    if op == "copy":
        dst = fresh(".txt")
        return (f"Copy /home/user/{src.path} to /home/user/{dst}.", f"cp {src.path} {dst}",
                [(f"{dst[:-4]}_is_copy", f"assert text({dst!r}) == {src.text!r}"),
                 unchanged(src.path, src.text, f"{src.path[:-4]}_kept")],
                [src], [], [dst], (op, src.path, dst))
    if op == "move":
        d = fresh()
        return (f"Move /home/user/{src.path} into the directory /home/user/{d}.", f"mv {src.path} {d}/",
                [(f"{src.path[:-4]}_moved", f"assert text({d + '/' + src.path!r}) == {src.text!r}"),
                 (f"{src.path[:-4]}_gone", f"assert not (HOME / {src.path!r}).exists()")],
                [src], [d], [], (op, src.path, d))
    other = File(src.path[:-4] + ".txt", lines_text([sentence(rng)]))  # the file beside it stays
    return (f"Delete the file /home/user/{src.path}.", f"rm {src.path}",
            [(f"{src.path[:-4]}_deleted", f"assert not (HOME / {src.path!r}).exists()"),
             unchanged(other.path, other.text, f"{other.path[:-4]}_kept")], [src, other], [], [], (op, src.path))


@family("basics", "files", BASIC_OPS)  # no held-out variant: every operation is in every split
def _basics(rng, difficulty, variant):
    n = {"easy": 1, "medium": 2, "hard": 3}[difficulty]
    ops = [variant] + [rng.choice(BASIC_OPS) for _ in range(n - 1)]
    taken: set = set()
    steps = [_basic_step(rng, op, taken) for op in ops]
    instr = " Then ".join(s[0] if i == 0 else s[0][0].lower() + s[0][1:] for i, s in enumerate(steps))
    return Spec(instr, "\n".join(s[1] for s in steps), [c for s in steps for c in s[2]],
                [f for s in steps for f in s[3]], dirs=[d for s in steps for d in s[4]],
                outputs=[o for s in steps for o in s[5]], params=tuple(s[6] for s in steps))
