"""The result tables in docs/ are what `asyncres_jax.plot` makes of the committed metrics, byte for byte: the runs
listed and labelled as scripts/study.sh and scripts/calibrate.sh list them."""

import pathlib

import pytest

from asyncres_jax import plot

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
STUDY_ROWS = {"es_sync": "ES sync", "es_async1": "ES async K=1", "es_delay4": "ES delay 4", "es_delay8": "ES delay 8",
              "grpo": "GRPO"}


def study_runs(folder: pathlib.Path) -> list[dict]:
    """scripts/study.sh's order: row by row, each row's seed-0 run then its other seeds; a row's label for all."""
    runs = []
    for row, label in STUDY_ROWS.items():
        for d in [folder / row, *sorted(folder.glob(f"{row}_seed*"))]:
            if (d / "eval.jsonl").is_file():
                runs.append({**plot.load_run(d), "name": label})
    return runs


def calibration_runs(folder: pathlib.Path) -> list[dict]:
    """scripts/calibrate.sh's: every setting's run directory, labelled without its -seedN."""
    return [{**plot.load_run(d), "name": d.name.split("-seed")[0]} for d in sorted(folder.glob("a*/"))]


def committed_table(doc: pathlib.Path) -> str:
    text = doc.read_text()
    return text.split(plot.TABLE_BEGIN + "\n", 1)[1].split("\n" + plot.TABLE_END, 1)[0]


@pytest.mark.parametrize("doc, runs", [
    ("results.md", lambda: study_runs(DOCS / "results")),
    ("pilot.md", lambda: study_runs(DOCS / "pilot")),
    ("calibration.md", lambda: calibration_runs(DOCS / "calibration")),
])
def test_each_docs_table_regenerates_from_the_committed_metrics(doc, runs):
    assert plot.table(runs()) == committed_table(DOCS / doc)
