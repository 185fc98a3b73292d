"""The documentation's commands and recipe keys are real: every `python -m fv_accel...`,
`accelerate launch ...` and `python train_*.py ...` command shown in README.md and docs/*.md (code
blocks and inline code) parses, and every recipe key the pages name exists in the config dataclasses.

A command is parsed in this process by the parser that would read it: `accelerate launch`'s own
argument parser for the launcher's options; for a module, its `main` up to its argument parser,
stopped right after the parse; for a training script, the recipe with its overrides, loaded and
validated and printed as `--dry-run` prints it (recipe and memory estimate). One real
`accelerate launch ... --dry-run` runs as a subprocess, as a user would type it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from fv_accel.config import ConfigError, RunConfig, _build_dataclass

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAIN_SCRIPTS = {"train_dfsft.py": "dfsft", "train_finetune.py": "finetune", "train_dmd2.py": "dmd2",
                 "train_self_forcing.py": "self_forcing", "train_diffusion_nft.py": "diffusion_nft", "train_kd.py": "kd",
                 "train_causal_cd.py": "causal_cd", "train_anyflow_pretrain.py": "anyflow_pretrain", "train_anyflow.py": "anyflow"}
SECTION_ROOTS = tuple(f.name for f in dataclasses.fields(RunConfig))
COMMAND_START = re.compile(r"(?:accelerate launch|python -m fv_accel\b|python train_(?:dfsft|finetune|dmd2|self_forcing|diffusion_nft|kd|causal_cd|anyflow_pretrain|anyflow)\.py)")


# ---- what the pages show ----

def code_blocks(text: str) -> list[str]:
    """Fenced blocks (their language tag dropped) and 4-space indented blocks, outside fences."""
    blocks, current, fenced = [], [], False
    indented: list[str] = []
    for line in text.split("\n"):
        if line.startswith("```"):
            if fenced:
                blocks.append("\n".join(current))
                current = []
            fenced = not fenced
            continue
        if fenced:
            current.append(line)
        elif line.startswith("    ") and line.strip():
            indented.append(line[4:])
        elif indented and not line.strip():
            indented.append("")
        elif indented:
            blocks.append("\n".join(indented))
            indented = []
    if indented:
        blocks.append("\n".join(indented))
    return blocks


def inline_code(text: str) -> list[str]:
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", outside)


def commands_in(text: str) -> list[str]:
    """Every command shown: a code line (continuation lines joined, a trailing `# comment` dropped)
    or an inline code span that starts with a documented entry point (after VAR=value prefixes)."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").split("\n"):
            line = re.sub(r"\s+#.*$", "", line).strip()
            if COMMAND_START.match(re.sub(r"^(\w+=\S+\s+)+", "", line)):
                found.append(line)
    for span in inline_code(text):
        if COMMAND_START.match(re.sub(r"^(\w+=\S+\s+)+", "", span.strip())):
            found.append(span.strip())
    return found


KEY_PATTERN = re.compile(r"(?<![\w./])((?:%s)(?:\.[A-Za-z_*][\w*]*)+)" % "|".join(SECTION_ROOTS))


# What the package says of a made-up key or option, quoted in the pages as an example of its errors.
QUOTED_ERROR = re.compile(r"unknown key '[^']*'|unknown option --\S+")


def dotted_keys_in(text: str) -> list[str]:
    """Dotted recipe keys named in code (inline or blocks): `training.optimizer.learning_rate`."""
    spans = [QUOTED_ERROR.sub("", span) for span in inline_code(text) + code_blocks(text)]
    return sorted({m.group(1) for span in spans for m in KEY_PATTERN.finditer(span)})


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces to hyphens)."""
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", outside, flags=re.M)
    }


def repo_paths_in(text: str) -> list[str]:
    """configs/ and accelerate_configs/ files named in the pages, `{a,b}` alternatives expanded."""
    found = set()
    for m in re.finditer(r"(?<![\w/])((?:accelerate_)?configs/[\w.{},-]+\.(?:yaml|sh))", text):
        path = m.group(1)
        alternatives = re.search(r"\{([^}]*)\}", path)
        options = alternatives.group(1).split(",") if alternatives else [None]
        for option in options:
            found.add(path if option is None else path[: alternatives.start()] + option + path[alternatives.end():])
    return sorted(found)


def table_keys_in(text: str) -> list[tuple[str, str]]:
    """(section, key) for the recipe tables: rows whose first cell is a section (`training.data`)
    and whose second cell lists its keys in code, values in parentheses; `name: {a, b: 1}` names
    the keys of a nested section."""
    pairs = []
    for line in text.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or not re.fullmatch(r"`[\w.]+`", cells[0]):
            continue
        section = cells[0].strip("`")
        if section.split(".")[0] not in SECTION_ROOTS or not is_section(section):
            continue  # not a recipe table, or a table of single keys (their defaults in the next cell)
        keys_cell = "|".join(cells[1:2])
        while re.search(r"\([^()]*\)", keys_cell):  # values and remarks, nested parentheses included
            keys_cell = re.sub(r"\([^()]*\)", "", keys_cell)
        for span in re.findall(r"`([^`]+)`", keys_cell):
            nested = re.fullmatch(r"(\w+): \{(.*)\}", span)
            if nested:
                for item in nested.group(2).split(","):
                    name = item.split(":")[0].strip()
                    if name != "...":
                        pairs.append((f"{section}.{nested.group(1)}", name))
            else:
                pairs.append((section, span))
    return pairs


# ---- the checks ----

def _section_type(tp: typing.Any) -> typing.Any:
    """An optional section (`Optional[StudentConfig]`, the distillation roles) as its dataclass."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else tp


def key_exists(dotted: str) -> bool:
    """A recipe key or section, by its dotted name; `heldout_*` matches a prefix, `section.*` the section."""
    node: typing.Any = RunConfig
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node):
            return False
        hints = typing.get_type_hints(node)
        if part == "*":
            return True
        if part.endswith("*"):
            return any(name.startswith(part[:-1]) for name in hints)
        if part not in hints:
            return False
        node = _section_type(hints[part])
    return True


def is_section(dotted: str) -> bool:
    """A dotted name that names a section of the recipe (a dataclass), not a key of one."""
    node: typing.Any = RunConfig
    for part in dotted.split("."):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return False
        node = _section_type(hints[part])
    return dataclasses.is_dataclass(node)


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def stop_after_parse():
    """argparse parses as it would, then raises _Parsed instead of returning to the caller."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def parse_module(module: str, argv: list[str]) -> argparse.Namespace | None:
    """`python -m <module> argv`: the module's main runs to its argument parser and stops there."""
    main = importlib.import_module(module).main
    err = io.StringIO()
    try:
        with stop_after_parse(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exit_:
        if exit_.code == 0 and {"-h", "--help"} & set(argv):
            return None  # `--help`, shown as the way to see the options and their defaults
        raise AssertionError(f"python -m {module} {shlex.join(argv)}: exit {exit_.code}: {err.getvalue().strip()}") from None
    raise AssertionError(f"python -m {module} {shlex.join(argv)}: main returned without parsing arguments")


# Recipes already run with --dry-run in this process: the memory estimate (a model built on the meta
# device) runs once per recipe file; every command's options are parsed and validated.
_DRY_RUN_RECIPES: set[str] = set()


def check_training_command(script: str, argv: list[str]) -> None:
    """`python <train script> argv`: the recipe and its overrides loaded and validated as the entry
    script does; the first command of each recipe file also with `--dry-run`."""
    from fv_accel.config import default_recipe, parse_cli

    cfg, _ = parse_cli(argv, TRAIN_SCRIPTS[script])
    recipe = getattr(cfg, "_source", "").split(" (with overrides")[0] or str(default_recipe(TRAIN_SCRIPTS[script]))
    if recipe not in _DRY_RUN_RECIPES:
        dry_run(script, argv)
        _DRY_RUN_RECIPES.add(recipe)


def dry_run(script: str, argv: list[str]) -> str:
    """`python <train script> argv --dry-run` in this process: its output (recipe + memory estimate)."""
    from fv_accel.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(TRAIN_SCRIPTS[script], [*argv, "--dry-run"])
    assert code == 0, f"{script} {shlex.join(argv)} --dry-run: exit {code}: {err.getvalue().strip()}"
    return out.getvalue()


def check_launch(argv: list[str]) -> None:
    """`accelerate launch argv`: the launcher's options, its config file, then what it launches."""
    from accelerate.commands.launch import launch_command_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = launch_command_parser().parse_args(argv)
    except SystemExit as exit_:
        raise AssertionError(f"accelerate launch {shlex.join(argv)}: exit {exit_.code}: {err.getvalue().strip()}") from None
    if args.config_file:
        assert (REPO / args.config_file).is_file(), f"accelerate launch: no config file {args.config_file}"
    check_target(args.training_script, list(args.training_script_args), module=args.module)


def check_target(target: str, argv: list[str], *, module: bool) -> None:
    if module:
        if target == "fv_accel.launch":
            check_launch(argv)
        else:
            parse_module(target, argv)
    elif target in TRAIN_SCRIPTS:
        check_training_command(target, argv)
    else:
        raise AssertionError(f"unknown entry point {target!r}")


def check_command(command: str) -> None:
    """One command as shown; an AssertionError says what does not parse. An entry point named
    alone (`accelerate launch`, `python -m fv_accel.plot`) is a mention: its module must exist."""
    tokens = shlex.split(command)
    while tokens and re.fullmatch(r"\w+=\S*", tokens[0]):
        tokens.pop(0)
    if tokens == ["accelerate", "launch"]:
        return
    if tokens[:2] == ["python", "-m"] and len(tokens) == 3:
        assert callable(getattr(importlib.import_module(tokens[2]), "main", None)), f"{tokens[2]} has no main"
        return
    if tokens[:2] == ["accelerate", "launch"]:
        check_launch(tokens[2:])
    elif tokens[:2] == ["python", "-m"]:
        check_target(tokens[2], tokens[3:], module=True)
    elif tokens[0] == "python":
        check_target(tokens[1], tokens[2:], module=False)
    else:
        raise AssertionError(f"not a command: {command}")


def check_yaml_block(block: str) -> None:
    """A YAML recipe fragment: every key known, every value of the right type."""
    data = yaml.safe_load(block)
    if isinstance(data, dict) and set(data) & set(SECTION_ROOTS):
        _build_dataclass(RunConfig, data, "", "a docs YAML block")


# ---- the tests ----

def test_the_pages_are_there_and_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.split("\n")) <= 250
    first = "\n".join(text.split("\n")[:40])
    assert "make demo" in first and "make test" in first
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", text))
    assert {page.name for page in PAGES[1:]} <= linked  # every page has its link
    assert len(PAGES) >= 10


def test_links_and_files_named_exist():
    problems = []
    for page in PAGES:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([\w-]+))?\)", text):
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file():
                problems.append(f"{page.name}: link to {target}")
            elif anchor and anchor not in heading_anchors(linked.read_text()):
                problems.append(f"{page.name}: link to {target}#{anchor}: no such heading")
        for path in repo_paths_in(text):
            if not (REPO / path).is_file():
                problems.append(f"{page.name}: {path} does not exist")
    assert not problems, "\n".join(problems)


def test_every_command_shown_parses():
    shown = {page.name: commands_in(page.read_text()) for page in PAGES}
    commands = sorted({c for cs in shown.values() for c in cs})
    assert len(commands) >= 30, commands  # the pages show commands, and the extraction finds them
    problems = []
    for command in commands:
        try:
            check_command(command)
        except (AssertionError, ConfigError) as err:
            where = [name for name, cs in shown.items() if command in cs]
            problems.append(f"{', '.join(where)}: {err}")
    assert not problems, "\n".join(problems)


def test_every_recipe_key_named_exists():
    problems = []
    n = 0
    for page in PAGES:
        text = page.read_text()
        for key in dotted_keys_in(text):
            n += 1
            if not key_exists(key):
                problems.append(f"{page.name}: `{key}`")
        for section, key in table_keys_in(text):
            n += 1
            if not key_exists(f"{section}.{key}"):
                problems.append(f"{page.name}: `{key}` in the row of `{section}`")
        for block in code_blocks(text):
            try:
                parsed = yaml.safe_load(block)
            except yaml.YAMLError:
                continue
            if isinstance(parsed, dict):
                n += 1
                try:
                    check_yaml_block(block)
                except ConfigError as err:
                    problems.append(f"{page.name}: {err}")
    assert n >= 150, n  # the pages name keys, and the extraction finds them
    assert not problems, "\n".join(problems)


def test_the_checks_fail_on_a_made_up_command_or_key():
    page = """
```bash
python -m fv_accel.preprocess --model m --input clips --output out --num_frams 81
accelerate launch train_dfsft.py --training.optimizer.learnig_rate 1e-4
```
Run `python -m fv_accel.exporter run --to diffusers`, or `accelerate launch --num_proceses 2 train_finetune.py`.
Set `training.optimizer.learning_rates`.

| `training.loop` | `max_train_steps`, `gradient_acumulation_steps` (1) |

```yaml
models:
  student:
    causl: true
```
"""
    commands = commands_in(page)
    assert len(commands) == 4
    for command in commands:
        with pytest.raises((AssertionError, ConfigError, ModuleNotFoundError)):
            check_command(command)
    keys = dotted_keys_in(page)
    assert keys == ["training.loop", "training.optimizer.learnig_rate", "training.optimizer.learning_rates"]
    assert [key for key in keys if not key_exists(key)] == keys[1:]
    assert table_keys_in(page) == [("training.loop", "max_train_steps"), ("training.loop", "gradient_acumulation_steps")]
    assert key_exists("training.loop.max_train_steps") and not key_exists("training.loop.gradient_acumulation_steps")
    (block,) = [b for b in code_blocks(page) if b.startswith("models:")]
    with pytest.raises(ConfigError, match="unknown key 'models.student.causl'"):
        check_yaml_block(block)


@pytest.mark.slow
def test_the_quick_start_recipe_run_launches_with_dry_run():
    """The README's recipe run through the real launcher (one process; the recipe's model config
    comes from the published architecture when it is not in the cache)."""
    readme = (REPO / "README.md").read_text()
    command = next(c for c in commands_in(readme) if c.startswith("accelerate launch train_dfsft.py --config"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    tokens = shlex.split(command)
    launcher = str(Path(sys.executable).with_name("accelerate"))
    done = subprocess.run([launcher, *tokens[1:], "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# memory estimate per process" in done.stdout and "method:\n  name: dfsft" in done.stdout
