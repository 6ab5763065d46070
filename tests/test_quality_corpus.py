"""The summary-quality corpus manifest and its loader (bench/bench_summary_quality.py): every
document is collectable on this machine's kind (Debian base-files, rqllm's PyPI dependencies, the
stdlib, examples/), the corpus is what the issue asks for, and a bad manifest names its problem."""
from __future__ import annotations

import pytest

from bench import bench_summary_quality as bench


def test_the_corpus_is_collected_from_installed_packages(tmp_path):
    manifest = bench.read_manifest()
    files = bench.collect_corpus(tmp_path, manifest=manifest)
    assert len(files) >= 15
    assert {e.kind for e in manifest.document} == {"legal", "technical", "narrative", "notes", "code"}
    sizes = {name: len(path.read_text(encoding="utf-8")) for name, path in files.items()}
    assert all(size > 1000 for size in sizes.values()), sizes
    assert sum(size > 40_000 for size in sizes.values()) >= 2  # over 10k tokens (about 3-4 chars a token)
    history = files["python-history"].read_text(encoding="utf-8")
    assert history.startswith("A. HISTORY OF THE SOFTWARE") and "B. TERMS AND CONDITIONS" not in history


def test_a_subset_and_unknown_names(tmp_path):
    files = bench.collect_corpus(tmp_path, ["apache-2.0", "team-sync-notes"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["apache-2.0.txt", "team-sync-notes.md"] == \
           sorted(p.name for p in files.values())
    with pytest.raises(bench.CorpusError, match="unknown document.*nope"):
        bench.collect_corpus(tmp_path, ["nope"])


@pytest.mark.parametrize("entry,needle", [
    ('name = "x"\nkind = "legal"\nsource = "debian"\nlicence = "MIT"\npackage = "p"', "needs `path`"),
    ('name = "x"\nkind = "poem"\nsource = "repo"\npath = "a"\nlicence = "MIT"', "kind"),
    ('name = "x"\nkind = "legal"\nsource = "pypi"\nlicence = "MIT"', "needs `package`"),
])
def test_bad_manifest_entries_are_named(tmp_path, entry, needle):
    path = tmp_path / "m.toml"
    path.write_text("[[document]]\n" + entry + "\n")
    with pytest.raises(bench.CorpusError, match=needle):
        bench.read_manifest(path)


def test_a_missing_source_says_what_provides_it():
    entry = bench.CorpusEntry(name="x", kind="code", source="pypi", package="no-such-dist-rqllm", licence="MIT")
    with pytest.raises(bench.CorpusError, match="pip install no-such-dist-rqllm"):
        bench.document_text(entry)
