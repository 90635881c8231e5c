# te_python_dirs(<out>): the directories of the build's Python environment that may hold the
# files of NVIDIA's pip wheels (nvidia/cudnn, nvidia/cu13, nvidia/cublas, ...): the `cudnn`
# package's parent (found without importing it, which would load cuDNN; covers a
# `pip install --target`), sys.path, and the environment's site directories. Empty without a
# Python interpreter.
include_guard(GLOBAL)

function(te_python_dirs out)
  set(dirs)
  find_package(Python3 QUIET COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c [=[
import importlib.util, os, site, sys, sysconfig
dirs = []
spec = importlib.util.find_spec("cudnn")
if spec is not None and spec.submodule_search_locations:
    dirs += [os.path.dirname(p) for p in spec.submodule_search_locations]
dirs += [p for p in sys.path if p]
dirs += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
if hasattr(site, "getsitepackages"):
    dirs += site.getsitepackages()
print(";".join(d for d in dict.fromkeys(dirs) if os.path.isdir(d)))
]=]
      OUTPUT_VARIABLE found OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
    if(rc EQUAL 0)
      set(dirs ${found})
    endif()
  endif()
  set(${out} ${dirs} PARENT_SCOPE)
endfunction()
