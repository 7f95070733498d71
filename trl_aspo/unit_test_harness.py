"""What `code_unit_test_reward` runs (this source, by `python -I -c`): the solution, the tests, then the proof.

It is trusted code that runs before the untrusted solution: it reads its whole payload from stdin (the nonce
included) and puts /dev/null in its place, sets its own resource limits, compiles the tests, keeps references to
everything it needs later, and installs an audit hook (which no code can remove) refusing the ways to reach its
frames and heap. Only after the tests returned does it write the nonce to the proof pipe."""

import ast
import builtins
import json
import os
import resource
import sys
import types


def _main():
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, limit in payload["limits"].items():
        resource.setrlimit(getattr(resource, name), (limit, limit))
    proof_fd, entry_point = payload["proof_fd"], payload["entry_point"]
    nonce = payload["nonce"].encode()
    guarded = ast.fix_missing_locations(_GuardedEquality().visit(ast.parse(payload["tests"], "<tests>")))
    tests = compile(guarded, "<tests>", "exec", dont_inherit=True, optimize=0)
    solution = compile(payload["solution"], "<solution>", "exec", dont_inherit=True, optimize=0)
    del payload
    pristine_builtins = dict(builtins.__dict__)
    compare = _equality_guard()
    write = os.write
    sys.addaudithook(_refuse_introspection)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(solution, namespace)
    visible = {
        name: value for name, value in namespace.items() if name not in pristine_builtins or name == entry_point
    }
    visible.update({"__name__": "__main__", "__builtins__": pristine_builtins, "__aspo_compare__": compare})
    exec(tests, visible)
    if entry_point is not None:
        visible["check"](visible[entry_point])
    write(proof_fd, nonce)


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
    kind_of, is_instance, identity = type, isinstance, id
    iterate = {list: list.__iter__, tuple: tuple.__iter__, set: set.__iter__, frozenset: frozenset.__iter__}
    dict_items = dict.items
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
                return all(plain(item, seen, budget) for item in values(value))
        if is_instance(value, dict):
            return all(plain(k, seen, budget) and plain(v, seen, budget) for k, v in dict_items(value))
        return True

    def compare(left, right, equal):
        same_leaf = kind_of(left) is kind_of(right) and not is_instance(left, (list, tuple, set, frozenset, dict))
        if not same_leaf and not (plain(left, set(), [100_000]) and plain(right, set(), [100_000])):
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


def _refuse_introspection(
    event,
    args,
    refused=_INTROSPECTION,
    frames=_FRAME_ATTRIBUTES,
    text=(str, bytes),
    is_instance=isinstance,
    fsdecode=os.fsdecode,
    realpath=os.path.realpath,
):
    """Audit hook: no frames, no heap walk, no ctypes, no /proc files (the harness's memory holds the nonce).
    ValueError, which `collections.namedtuple` and `typing` catch when they look for their caller's module."""
    if event in refused or event.startswith("ctypes."):
        raise ValueError(f"{event} is not allowed in the unit-test sandbox")
    if event == "object.__getattr__" and args[1] in frames:
        raise ValueError(f"{args[1]} is not allowed in the unit-test sandbox")
    if event == "open" and is_instance(args[0], text) and realpath(fsdecode(args[0])).startswith("/proc/"):
        raise ValueError("/proc files are not allowed in the unit-test sandbox")


if __name__ == "__main__":
    _main()
