"""`plugins`: the user's modules a `trl-aspo train` run imports before its configuration is checked, so that the
losses and advantage estimators they register (`register_policy_loss`, `register_advantage_estimator`) are names
`loss_type` and `advantage_estimator` accept, in the check before the model loads and in every training process.

A plugin is a dotted module name, found on the Python path or in the working folder (as the dotted paths of
`reward_funcs`). Importing one usually imports torch; once one is imported, the config modules that declare
registry-held fields are imported too, so the checks read the registries' names as they are now
(`trl_aspo.cli.value_checks.field_choices`)."""

from __future__ import annotations

import importlib
import os
import sys
import traceback


def plugin_problems(names: list[str], fields: dict[str, dict]) -> list[str]:
    """Import each plugin (`names`), then the config modules of the registry-held `fields`; a line for each plugin
    that cannot be found or raised while it was imported, naming it."""
    if not names:
        return []
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    problems = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            problems.append(
                f"plugins entry {name!r}: {error} (a dotted module name, found on the Python path or in the working "
                f"folder {os.getcwd()})"
            )
        except Exception as error:  # noqa: BLE001 - the user's module: whatever it raised is reported, named
            where = traceback.extract_tb(error.__traceback__)[-1]
            problems.append(
                f"plugins entry {name!r}: importing it raised {type(error).__name__}: {error} "
                f"({where.filename}, line {where.lineno})"
            )
    for module in sorted({field["registry"] for field in fields.values() if field.get("registry")}):
        importlib.import_module(module)
    return problems
