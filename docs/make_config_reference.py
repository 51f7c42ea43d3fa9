"""Writes docs/config.md, the config reference, from the typed schema and the presets as they are now.

    python docs/make_config_reference.py            # rewrites docs/config.md
    python docs/make_config_reference.py --check    # exit 1 when docs/config.md is out of date

The keys and defaults come from composing the default config with Hydra's compose API (configs/config.yaml over
the schema of training/config.py and models/config.py), exactly what ``train.py --cfg job`` prints. Each key's
meaning is the trailing ``# ...`` comment of its line in the YAML file that sets its default (configs/config.yaml,
configs/<group>/<option>.yaml), continued by the comment lines aligned under it; a very short one is read after
the heading comment of its block. A key no YAML file comments falls back to the schema's own trailing comment,
then to the short table ``EXTRA_MEANINGS`` below. The presets' sections list what ``+experiment=blender`` and
``+experiment=capture`` change against the default.
"""

import argparse
import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
OUTPUT = REPO / "docs" / "config.md"
PRESETS = ("blender", "capture")
SCHEMA_FILES = (REPO / "training" / "config.py", REPO / "models" / "config.py")
SHORT_MEANING = 30  # a comment shorter than this is read under its section's heading comment, when it has one
MAX_MEANING = 240  # characters of a meaning before it is cut at a clause boundary

# Keys whose line carries no comment in any YAML file or in the schema (e.g. the second half of a pair).
EXTRA_MEANINGS = {
    "far": "far end of the rays' distance range (scene units)",
    "data.far": "far end of the rays' distance range (scene units)",
    "data.name": "the scene source: the data=<name> group, configs/data/<name>.yaml",
}

# The schema's dataclasses and the key prefix their fields live under (every *DataConfig: data.).
SCHEMA_PREFIXES = {
    "OpsConfig": "ops.",
    "TrainConfig": "train.",
    "Config": "",
    "ModelConfig": "model.",
    "OccupancyConfig": "model.occupancy.",
    "FineConfig": "model.fine.",
}

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<rest>.*)$")


def _trailing_comment(text: str) -> tuple[str, int] | None:
    """The ``# comment`` at the end of a YAML value (outside quotes) and its column in ``text``, or None."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[i + 1 :].strip(), i
    return None


def yaml_comments(path: Path, prefix: str) -> dict[str, str]:
    """``full key -> comment`` for every key line of ``path`` that carries a trailing comment, joined with the
    comment-only lines right below it whose ``#`` sits in the same column. ``prefix`` is the group's key path."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    last_key, last_column = None, None
    section, seen_key = None, False  # a block comment (not the file's opening one) heading the keys up to a blank line
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            last_key, section, seen_key = None, None, True
            continue
        if stripped.startswith("#"):
            column = len(line) - len(line.lstrip())
            if last_key is not None and column == last_column:
                comments[last_key] += " " + stripped[1:].strip()
            else:
                last_key = None
                if seen_key and section is None:
                    section = stripped[1:].strip()
            continue
        seen_key = True
        match = KEY_LINE.match(line)
        if match is None:  # a list item or a flow value's continuation
            last_key = None
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = prefix + ".".join([k for _, k in stack] + [match["key"]])
        stack.append((indent, match["key"]))
        found = _trailing_comment(match["rest"])
        if found is None:
            last_key = None
            continue
        comments[key] = found[0]
        if section and len(found[0]) < SHORT_MEANING:
            comments[key] = f"{section.rstrip('.:')}: {found[0]}"
        last_key, last_column = key, len(line) - len(match["rest"]) + found[1]
    return comments


def schema_comments() -> dict[str, str]:
    """``full key -> comment`` from the trailing comments of the schema's dataclass fields."""
    comments: dict[str, str] = {}
    for path in SCHEMA_FILES:
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ClassDef):
                continue
            prefix = "data." if node.name.endswith("DataConfig") else SCHEMA_PREFIXES.get(node.name)
            if prefix is None:
                continue
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found = _trailing_comment(lines[item.end_lineno - 1])
                    if found:
                        comments.setdefault(prefix + item.target.id, found[0])
    return comments


def default_groups() -> dict[str, str]:
    """``group -> option`` from configs/config.yaml's defaults list (``data: synthetic``, ``model: default``, ...)."""
    import yaml

    entries = yaml.safe_load((CONFIGS / "config.yaml").read_text())["defaults"]
    return {k: v for entry in entries if isinstance(entry, dict) for k, v in entry.items() if "/" not in k}


def scene_sources(default: str) -> list[str]:
    """The ``data=<name>`` options besides the default one (configs/data/*.yaml)."""
    return sorted(path.stem for path in (CONFIGS / "data").glob("*.yaml") if path.stem != default)


def meanings(data_name: str) -> dict[str, str]:
    """Every key's meaning for a config whose scene source is ``data_name``: the defaults' YAML comments first."""
    table = dict(schema_comments())
    table.update({k: v for k, v in EXTRA_MEANINGS.items() if "." in k})
    for group, option in default_groups().items():
        option = data_name if group == "data" else option
        table.update(yaml_comments(CONFIGS / group / f"{option}.yaml", f"{group}."))
    table.update({k: v for k, v in yaml_comments(CONFIGS / "config.yaml", "").items() if not k.startswith("hydra")})
    return table


def one_line(text: str) -> str:
    """A meaning on one table line: pipes escaped, cut at a clause boundary past ``MAX_MEANING`` characters."""
    text = " ".join(text.split())
    if len(text) > MAX_MEANING:
        cut = max(text.rfind(sep, 0, MAX_MEANING) for sep in ("; ", ": ", ", ", " ("))
        text = text[: cut if cut > MAX_MEANING // 2 else MAX_MEANING].rstrip(" ,;:(") + " ..."
    return text.replace("|", "\\|")


def compose(overrides: list[str]) -> dict:
    """The composed job config (no ``hydra`` node) as a plain dict, interpolations kept as written."""
    sys.path.insert(0, str(REPO))
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=False)


def flatten(node: dict, prefix: str = "") -> dict[str, object]:
    """``dotted key -> leaf value`` in the config's own order (lists are leaves)."""
    flat: dict[str, object] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def show(value: object) -> str:
    """A value as it would be written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value).replace('"', "")
    return str(value)


def key_table(keys: dict[str, object], table: dict[str, str], value_header: str = "default") -> list[str]:
    rows = [f"| key | {value_header} | meaning |", "| --- | --- | --- |"]
    for key, value in keys.items():
        rows.append(f"| `{key}` | `{show(value)}` | {one_line(table.get(key, ''))} |")
    return rows


def missing_meanings() -> list[str]:
    """The default config's keys that have no meaning (the reference must give each one)."""
    table = meanings(flatten(compose([]))["data.name"])
    return [key for key in flatten(compose([])) if not table.get(key)]


def render() -> str:
    """The whole of docs/config.md."""
    default = flatten(compose([]))
    table = meanings(str(default["data.name"]))
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `python docs/make_config_reference.py` from the schema (training/config.py,",
        "models/config.py) and the comments in configs/; edit those, then rerun it. tests/test_docs.py checks it. -->",
        "",
        "Every key of the default config (`python3 train.py --cfg job` prints it), its default and what it does.",
        "Set any of them on the command line (`python3 train.py train.iters=3000 model.resolution_end=160`); an",
        "unknown key or a wrong type stops before any work, naming the key. Why the presets' values were chosen:",
        "[decisions.md](decisions.md).",
        "",
        f"## Keys ({len(default)})",
        "",
        *key_table(default, table),
        "",
    ]
    for name in scene_sources(str(default["data.name"])):
        source = flatten(compose([f"data={name}"]))
        source_table = meanings(name)
        changed = {k: v for k, v in source.items() if k.startswith("data.") and default.get(k, object()) != v}
        dropped = [k for k in default if k.startswith("data.") and k not in source]
        lines += [
            f"## Scene source `data={name}`",
            "",
            f"What `data={name}` adds or sets differently"
            + (f" (it has no {', '.join(f'`{k}`' for k in dropped)})" if dropped else "")
            + ":",
            "",
            *key_table(changed, source_table, "value"),
            "",
        ]
    for name in PRESETS:
        preset = flatten(compose([f"+experiment={name}"]))
        preset_table = meanings(str(preset["data.name"]))
        changed = {k: v for k, v in preset.items() if default.get(k, object()) != v}
        lines += [
            f"## Preset `+experiment={name}`",
            "",
            f"`configs/experiment/{name}.yaml` sets these keys (values that differ from the default config; the",
            "scene source's own keys included):",
            "",
            *key_table(changed, preset_table, "value"),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is not what it would write")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(REPO)} is out of date: run python docs/make_config_reference.py")
            return 1
        return 0
    OUTPUT.write_text(text)
    for key in missing_meanings():
        print(f"warning: {key} has no meaning (add a trailing comment in configs/)", file=sys.stderr)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
