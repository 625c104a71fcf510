"""Pictures of built docs pages, for looking at them without a browser (this machine has none, and PyPI ships no
Chromium): WeasyPrint lays the page out with its HTML and the theme's CSS (no JavaScript) into a PDF, pdfium draws
its pages as PNG. Material's layout leaves the first PDF page empty, so the second is the one to look at. Not a
browser screenshot: fonts and the navigation differ; the content, code blocks and signatures are as built.

    python3 -m venv /tmp/shots && /tmp/shots/bin/pip install weasyprint pypdfium2
    .venv/bin/mkdocs build -d /tmp/site
    /tmp/shots/bin/python scripts/docs_screenshots.py /tmp/site docs/images grpo api/trainers
"""

import sys
from pathlib import Path

import pypdfium2 as pdfium
import weasyprint

HIDE = ("@page { size: 1100px 1400px; margin: 0 } "
        ".md-sidebar, .md-header, .md-footer, .md-search, .md-tabs { display: none !important }")


def main(site: Path, out: Path, pages: list[str]) -> None:
    for page in pages:
        pdf = weasyprint.HTML(filename=str(site / page / "index.html")).write_pdf(stylesheets=[weasyprint.CSS(string=HIDE)])
        doc = pdfium.PdfDocument(pdf)
        name = page.replace("/", "-").strip("-") or "index"
        for i in range(len(doc)):
            doc[i].render(scale=1.0).to_pil().save(out / f"docs-{name}-{i + 1}.png")
        print(f"{page}: {len(doc)} PDF pages -> {out}/docs-{name}-*.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
