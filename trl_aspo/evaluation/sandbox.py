"""What `code_unit_test_reward` runs (this source, by `python -I -c`): the solution, the tests, then the proof.

It is trusted code that runs before the untrusted solution: it reads its whole payload from stdin and puts /dev/null
in its place, sets its own resource limits, compiles the tests and keeps references to everything it calls later
(so rebinding `builtins.exec` or `sys.audit` changes nothing). The nonce goes straight into an audit hook (which no
code can remove or reach: no frame holds the nonce) that also refuses the ways to walk frames and the heap. After the
tests returned, the harness raises the audit event `aspo.tests_done`; the hook writes the nonce to the proof pipe only
when that event comes from the harness's own frame, which nothing but reaching that line can do."""

import ast
import builtins
import json
import os
import resource
import sys
import threading
import types

_TESTS_DONE = "aspo.tests_done"


def _main():
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, limit in payload["limits"].items():
        resource.setrlimit(getattr(resource, name), (limit, limit))
    entry_point = payload["entry_point"]
    guarded = ast.fix_missing_locations(_GuardedEquality().visit(ast.parse(payload["tests"], "<tests>")))
    tests = compile(guarded, "<tests>", "exec", dont_inherit=True, optimize=0)
    solution = compile(payload["solution"], "<solution>", "exec", dont_inherit=True, optimize=0)
    pristine_builtins = dict(builtins.__dict__)
    compare = _equality_guard()
    run, announce = exec, sys.audit
    sys.addaudithook(_sandbox_hook(payload.pop("nonce").encode(), payload.pop("proof_fd"), sys._getframe()))
    del payload
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    run(solution, namespace)
    visible = {
        name: value for name, value in namespace.items() if name not in pristine_builtins or name == entry_point
    }
    visible.update({"__name__": "__main__", "__builtins__": pristine_builtins, "__aspo_compare__": compare})
    run(tests, visible)
    if entry_point is not None:
        visible["check"](visible[entry_point])
    announce(_TESTS_DONE)


class _GuardedEquality(ast.NodeTransformer):
    """`a == b` and `a != b` inside an assert become `__aspo_compare__(a, b, equal)`."""

    def visit_Assert(self, node):
        node.test = _EqualityCalls().visit(node.test)
        return node


class _EqualityCalls(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        equal = ast.Constant(isinstance(node.ops[0], ast.Eq))
        call = ast.Call(ast.Name("__aspo_compare__", ast.Load()), [node.left, node.comparators[0], equal], [])
        return ast.copy_location(call, node)


def _equality_guard():
    """`compare(left, right, equal)`: `left == right` (or `!=`), False when an operand's equality is Python code
    that the other operand's type does not share (an object equal to everything). Everything it calls is bound
    here, before the solution runs, so rebinding builtins or this module's names changes nothing."""
    c_level = (types.WrapperDescriptorType, types.MethodDescriptorType, types.BuiltinFunctionType)
    mro_of = type.__dict__["__mro__"].__get__
    dict_of = type.__dict__["__dict__"].__get__
    kind_of, is_instance, identity, every, new_set = type, isinstance, id, all, set
    iterate = {list: list.__iter__, tuple: tuple.__iter__, set: set.__iter__, frozenset: frozenset.__iter__}
    dict_type, dict_items, containers = dict, dict.items, (list, tuple, set, frozenset, dict)
    eq, ne = (lambda a, b: a == b), (lambda a, b: a != b)

    def own_equality(kind):
        for name in ("__eq__", "__ne__"):
            for klass in mro_of(kind):
                found = dict_of(klass)
                if name in found:
                    if not is_instance(found[name], c_level):
                        return False
                    break
        return True

    def plain(value, seen, budget):
        if budget[0] <= 0 or identity(value) in seen:
            return True
        budget[0] -= 1
        kind = kind_of(value)
        if not own_equality(kind):
            return False
        seen.add(identity(value))
        for container, values in iterate.items():
            if is_instance(value, container):
                return every(plain(item, seen, budget) for item in values(value))
        if is_instance(value, dict_type):
            return every(plain(k, seen, budget) and plain(v, seen, budget) for k, v in dict_items(value))
        return True

    def compare(left, right, equal):
        same_leaf = kind_of(left) is kind_of(right) and not is_instance(left, containers)
        if not same_leaf and not (plain(left, new_set(), [100_000]) and plain(right, new_set(), [100_000])):
            return False
        return eq(left, right) if equal else ne(left, right)

    return compare


_INTROSPECTION = frozenset(
    {
        "sys._getframe",
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    }
)
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})


def _sandbox_hook(nonce: bytes, proof_fd: int, harness_frame, stat=os.stat, fspath=os.fspath, write=os.write):
    """The audit hook: on `aspo.tests_done` from `harness_frame` (once), the nonce to the proof pipe; refuses frame
    access, heap walks, tracing, ctypes and opening files on /proc (the harness's memory). ValueError, which
    `collections.namedtuple` and `typing` catch when they look for their caller's module."""
    # Bound here: the solution can rebind this module's names and the builtins, not a closure's cells.
    getframe, thread_id, is_instance = sys._getframe, threading.get_ident, isinstance
    done, refused, frame_attributes = _TESTS_DONE, _INTROSPECTION, _FRAME_ATTRIBUTES
    proc_device = stat("/proc").st_dev if os.path.isdir("/proc") else None
    reading_frames: list[int] = []
    proved: list[bool] = []

    def hook(event, args):
        if event == done:
            reading_frames.append(thread_id())
            try:
                caller = getframe(1)
            finally:
                reading_frames.pop()
            if caller is harness_frame and not proved:
                proved.append(True)
                write(proof_fd, nonce)
            return
        if event in refused or event.startswith("ctypes."):
            if event == "sys._getframe" and thread_id() in reading_frames:
                return
            raise ValueError(f"{event} is not allowed in the unit-test sandbox")
        if event == "object.__getattr__" and args[1] in frame_attributes:
            raise ValueError(f"{args[1]} is not allowed in the unit-test sandbox")
        if event == "open" and proc_device is not None and not is_instance(args[0], int):
            try:
                device = stat(fspath(args[0])).st_dev
            except (OSError, TypeError, ValueError):
                return  # a file that does not exist yet is not on /proc
            if device == proc_device:
                raise ValueError("/proc files are not allowed in the unit-test sandbox")

    return hook


if __name__ == "__main__":
    _main()
