"""Building the project's kernels side by side (engine/cpp_build.py): every loader runs, once, and one that
fails does not stop the others or raise (it fails again, with its message, where it is used)."""
import platform
import threading

from minillm.engine.cpp_build import _vector_isas_to_check, build_side_by_side


def test_every_loader_runs_once_and_a_failing_one_raises_nothing():
    calls, lock = [], threading.Lock()

    def loader(name):
        def load():
            with lock:
                calls.append(name)
            if name == "broken":
                raise RuntimeError("no compiler")
            return name
        return load

    build_side_by_side(loader("a"), loader("broken"), loader("b"))
    assert sorted(calls) == ["a", "b", "broken"]
    build_side_by_side()                       # nothing to build: nothing happens


def test_the_vector_checks_are_the_ones_inductor_makes_here():
    from torch._inductor import cpu_vec_isa
    isas = _vector_isas_to_check()
    if platform.machine() not in ("x86_64", "AMD64"):      # Inductor checks its one candidate itself
        assert isas == []
        return
    assert all(isa in cpu_vec_isa.supported_vec_isa_list for isa in isas)
    assert [i for i in cpu_vec_isa.valid_vec_isa_list() if i] == [i for i in isas if i]
