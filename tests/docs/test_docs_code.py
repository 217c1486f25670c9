"""Every code block of the README and the docs runs as written, or says why it cannot: the
README's end-to-end example in the fast tier, each docs page (its blocks in order, one
namespace) in the slow tier."""

import pytest

from tests.docs.codeblocks import ROOT, blocks, pages, run_page

PAGES = pages()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_or_gives_its_reason(page):
    for b in blocks(page):
        if b.not_run is None:
            assert b.language == "python", (f"{b.page}:{b.line}: a ```{b.language} block runs only as python; "
                                            "mark it <!-- not-run: REASON --> or make it python")


def test_the_readmes_end_to_end_example_runs():
    running = [b for b in blocks(ROOT / "README.md") if b.not_run is None]
    assert any("manager.schedule" in b.code and "runner.run" in b.code and "save_cache" in b.code
               for b in running), running
    done = run_page(ROOT / "README.md")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_page_runs(page):
    if not any(b.not_run is None for b in blocks(page)):
        pytest.skip(f"{page.name}: every block says why it is not run")
    done = run_page(page)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
