"""How every `trl-aspo` command reads YAML (`--config` files of train, evaluate and compare, `compare key=value`
overrides): YAML's safe types only, each key of a mapping once, and aliases that stand for a bounded number of nodes.
A file that breaks a rule is a `ConfigurationError` naming it and the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trl_aspo.cli.config_errors import ConfigurationError, shown

# Nodes that YAML aliases may add beyond those written in a file: a config holds a few hundred values, while nine
# nested lists of ten aliases each (the "billion laughs") stand for 10^9.
ALIAS_EXPANSION_LIMIT = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml(text: str, source: str) -> Any:
    """The value of one YAML document, read with YAML's safe types only, each mapping key given once, and aliases
    that stand for at most `ALIAS_EXPANSION_LIMIT` nodes beyond those written. ConfigurationError naming `source`
    (and the line) otherwise.

    A key given twice is refused: YAML keeps only its last value without a word, so the first one, which the author
    also meant, would silently do nothing. (`<<: *common` followed by a key of `common` is no repeat: an explicit key
    overrides a merged one by YAML's merge rule.)

    Aliases are bounded rather than refused: a variant written as `<<: *common` plus its own keys is plain YAML.
    An alias does not copy its node (the loaded value shares it), but every consumer of a config walks it as a
    tree (the dataclass checks, `json.dumps` of a run config, a repr in a message), and a tree of 10^9 nodes ends
    in MemoryError there; the walk here counts each distinct node once (linear in the file)."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                self.aliases.setdefault(f"*{event.anchor}", event.start_mark.line + 1)
            return super().compose_node(parent, index)

    loader = BoundedLoader(text)
    loader.aliases = {}  # alias -> the line it is first used on
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        repeated = _repeated_key(node)
        if repeated is not None:
            key, first, line = repeated
            raise ConfigurationError(
                [
                    f"{source} (line {line}): the key {shown(key)} is given twice (first on line {first}); YAML would "
                    "keep only the last value: write each key once"
                ]
            )
        if loader.aliases:
            written, expanded = _node_counts(node)
            if expanded - written > ALIAS_EXPANSION_LIMIT:
                named = [f"{alias} (line {line})" for alias, line in list(loader.aliases.items())[:3]]
                raise ConfigurationError(
                    [
                        f"{source}: its aliases ({', '.join(named)}"
                        f"{', ...' if len(loader.aliases) > 3 else ''}) expand to {expanded:,} values for the "
                        f"{written:,} written; at most {ALIAS_EXPANSION_LIMIT:,} more are allowed (an alias bomb?): "
                        "write the values out"
                    ]
                )
        return loader.construct_document(node)
    except yaml.constructor.ConstructorError as error:
        mark = error.problem_mark
        line = "" if mark is None else f" (line {mark.line + 1})"
        problem = " ".join(str(error.problem or error).split()).replace("tag:yaml.org,2002:", "!!")
        if "python/" in problem:
            problem = f"{problem}: trl-aspo reads plain YAML only, and python tags would build objects or run code"
        raise ConfigurationError([f"{source}{line}: {problem}"]) from None
    except RecursionError:
        raise ConfigurationError([f"{source}: nested too deeply, or an alias inside its own anchor"]) from None
    except yaml.YAMLError as error:
        raise ConfigurationError([f"{source}: not valid YAML: {' '.join(str(error).split())}"]) from None
    finally:
        loader.dispose()


def _repeated_key(root) -> tuple[str, int, int] | None:
    """(key, its first line, the line it is given again) of the first mapping in a composed YAML node graph that
    writes a scalar key twice, or None. Keys compare as written with their resolved tag (`'a'` and `a` are one key);
    merge keys (`<<`) are skipped. Each distinct node is visited once."""
    import yaml

    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            first_lines: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                stack += [key_node, value_node]
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                    continue
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in first_lines:
                    return key_node.value, first_lines[key], line
                first_lines[key] = line
    return None


def _node_counts(root) -> tuple[int, int]:
    """(distinct nodes, nodes counting each alias as a copy of its anchor's node) of a composed YAML node graph, each
    distinct node visited once; RecursionError for an alias inside its own anchor (a cycle)."""
    import yaml

    expanded: dict[int, int] = {}  # id of a distinct node -> its size counting aliases as copies
    visiting: set[int] = set()

    def walk(node) -> int:
        key = id(node)
        if key in expanded:
            return expanded[key]
        if key in visiting:
            raise RecursionError("an alias inside its own anchor")
        visiting.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [item for pair in node.value for item in pair]
        else:
            children = []
        expanded[key] = 1 + sum(walk(child) for child in children)
        visiting.discard(key)
        return expanded[key]

    total = walk(root)
    return len(expanded), total


def read_config(path: str) -> dict[str, Any]:
    """The mapping of a `--config` YAML file; ConfigurationError naming the file when it cannot be one."""
    if path == "":
        raise ConfigurationError(["--config: needs a YAML file"])
    if not Path(path).expanduser().is_file():
        raise ConfigurationError([f"--config {path!r}: no such file"])
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigurationError([f"--config {path!r}: cannot be read: {error}"]) from None
    config = load_yaml(text, f"--config {path!r}")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigurationError(
            [f"--config {path!r}: must hold a mapping of keys to values, not a {type(config).__name__}"]
        )
    env = config.get("env", {})
    if not isinstance(env, dict):
        raise ConfigurationError([f"env (in {path}): must be a mapping of variable names to values"])
    return config
