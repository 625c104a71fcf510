"""examples/quickstart.ipynb executed by a real Jupyter kernel (ipykernel through nbclient), as a user runs it:
SFT, then GRPO with a Python reward, save, reload, generate. Its outputs are read back for what a person needs
to see in a notebook: the start-up summary, a loss line for the short run, the completions table."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.real_model
NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


def cell_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", "") + out["data"].get("text/html", ""))
        elif out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
    return "".join(parts)


def test_the_quickstart_notebook_runs_and_shows_what_a_person_needs(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel is this interpreter's (the venv's), started in a scratch folder for the outputs
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    if os.environ.get("TOOLKIT_WRITE_NOTEBOOK"):  # refresh the committed outputs (examples/quickstart.ipynb)
        nbformat.write(nb, NOTEBOOK)
    code = [c for c in nb.cells if c.cell_type == "code"]
    sft_out, grpo_out, reload_out = cell_text(code[1]), cell_text(code[2]), cell_text(code[3])
    # the start-up summary of each trainer, shown although nothing configured logging in the kernel
    assert "[toolkit] SFT" in sft_out, sft_out[-3000:]
    assert "[toolkit] GRPO loss settings" in grpo_out, grpo_out[-3000:]
    # a loss line at the first step of SFT (logging_steps 10 would show none before step 10)
    assert "step 1/16 | loss " in sft_out and "step 1/2 | loss " in grpo_out
    # the RL part learns something: at least one step's groups disagreed, so the weights moved
    import re

    learned = re.search(r"GRPO steps whose groups disagreed \(an update\): (\d+) of 2", grpo_out)
    assert learned and int(learned.group(1)) >= 1, grpo_out[-3000:]
    # the completions table (log_completions)
    assert "| prompt | completion | correct | reward | advantage |" in grpo_out
    assert "->" in reload_out and "(expected" in reload_out
    assert (tmp_path / "outputs" / "quickstart-grpo" / "final" / "model.safetensors").exists()
