"""kernels.yaml validation: every class of bad input gets an error naming file, line, kernel and field."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from registry.errors import ManifestError
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT

GOOD = {
    "schema_version": 1,
    "kernels": [{
        "name": "toy",
        "kernel_attr": "toy",
        "description": "a toy kernel",
        "wrapper": "tests.toy_wrapper:build",
        "enable": {"env": "MLX_AOT_TOY", "default": True},
        "requires": ["head_dim % 2 == 0", {"expr": "rope is not None", "reason": "{rope_error}"}],
        "signature": {
            "buffers": [{"name": "x", "role": "input"}, {"name": "y", "role": "output", "like": "x"},
                        {"name": "pool", "role": "inplace"}],
            "scalars": [{"name": "n", "type": "int32"}, {"name": "s", "type": "float32", "specialize": True}],
        },
        "entries": {"float32": "toy_f32", "float16": "toy_f16"},
        "cuda": {"sources": ["src/toy.cu"], "include_dirs": ["src"], "archs": ["sm_90"],
                 "ptx_arch": "compute_90"},
        "metal": {"sources": ["src/toy.metal"], "std": "metal3.1", "macos_min": "14.0"},
        "cpu": {"sources": ["src/toy.cpp"]},
    }],
}


def write(tmp_path: Path, data=None, text: str | None = None) -> Path:
    (tmp_path / "src").mkdir(exist_ok=True)
    for name in ("toy.cu", "toy.metal", "toy.cpp"):
        (tmp_path / "src" / name).write_text("// toy\n")
    path = tmp_path / "kernels.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(data, sort_keys=False))
    return path


def problems(tmp_path, mutate) -> str:
    data = copy.deepcopy(GOOD)
    mutate(data)
    with pytest.raises(ManifestError) as e:
        load_manifest(write(tmp_path, data))
    return str(e.value)


def test_real_manifest_loads():
    m = load_manifest()
    k = m.kernel("rope_pool_fused")
    assert k.kernel_attr == "rope"
    assert {"float16", "bfloat16", "float32", "bfloat16/float32"} <= set(k.entries)
    assert [b.name for b in k.signature.outputs] == ["q_out", "k_out", "k_pool", "v_pool"]
    assert all(p.is_file() for t in k.targets for p in k.source_paths(t))


def test_every_kernel_has_a_gpu_sanitizer_case():
    """tests/gpu/test_gpu_sanitizer.py runs on the GPU host only; its coverage is checked everywhere."""
    from tests.gpu.test_gpu_sanitizer import CASES

    missing = sorted({k.name for k in load_manifest().kernels} - set(CASES))
    assert not missing, f"add an out-of-range case for {missing} to CASES in tests/gpu/test_gpu_sanitizer.py"


def test_uint32_buffers_and_the_cache_format_in_requirements(tmp_path):
    """A quantized pool's packed words are a fixed uint32 buffer; kv_bits, kv_group_size and
    kv_scales_dtype are context names."""
    data = copy.deepcopy(GOOD)
    data["kernels"][0]["signature"]["buffers"].append({"name": "words", "role": "inplace", "dtype": "uint32"})
    data["kernels"][0]["requires"] = ["kv_bits in (4, 8) and head_dim % kv_group_size == 0",
                                      {"expr": "kv_scales_dtype == dtype", "reason": "scales {kv_scales_dtype}"}]
    k = load_manifest(write(tmp_path, data)).kernels[0]
    assert k.signature.buffers[-1].dtype == "uint32"
    ctx = dict(kv_bits=8, kv_group_size=64, head_dim=128, kv_scales_dtype="bfloat16", dtype="bfloat16")
    assert all(r.holds(ctx) for r in k.requires)
    assert not k.requires[0].holds(dict(ctx, kv_bits=None))
    assert k.requires[1].explain(dict(ctx, kv_scales_dtype="float32")) == "scales float32"


def test_good_toy_manifest(tmp_path):
    m = load_manifest(write(tmp_path, GOOD))
    k = m.kernels[0]
    assert k.targets["cuda"].archs == ("sm_90",)
    assert k.signature.scalars[1].specialize is True
    assert k.line == 3
    with pytest.raises(Exception):  # frozen
        k.name = "other"


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["kernels"][0].update(colour="red"), "kernel 'toy': unknown key 'colour'"),
    (lambda d: d["kernels"][0].pop("wrapper"), "kernel 'toy': missing required key 'wrapper'"),
    (lambda d: d["kernels"][0].update(name="Bad-Name"), "name: 'Bad-Name' is not an identifier"),
    (lambda d: d["kernels"][0].update(kernel_attr=3), "kernel_attr: expected a string, got an integer 3"),
    (lambda d: d["kernels"][0].update(wrapper="no_colon"), "wrapper: 'no_colon' is not a 'module.path:attr'"),
    (lambda d: d["kernels"][0]["enable"].update(env="lower"), "enable.env: 'lower' is not an environment variable"),
    (lambda d: d["kernels"][0]["enable"].update(default="yes"), "enable.default: expected true or false"),
    (lambda d: d["kernels"][0]["cuda"].update(sources=["src/missing.cu"]),
     "cuda.sources[0]: src/missing.cu does not exist"),
    (lambda d: d["kernels"][0]["cuda"].update(sources=["/etc/passwd"]), "cuda.sources[0]: '/etc/passwd' is absolute"),
    (lambda d: d["kernels"][0]["cpu"].update(sources=["../outside.cpp"]),
     "cpu.sources[0]: '../outside.cpp' escapes the project root"),
    (lambda d: d["kernels"][0]["cuda"].update(include_dirs=["nope"]), "cuda.include_dirs[0]: directory nope does not exist"),
    (lambda d: d["kernels"][0]["cpu"].update(sources=["src"]), "cpu.sources[0]: src is not a regular file"),
    (lambda d: d["kernels"][0]["cuda"].update(include_dirs=["src/toy.cu"]),
     "cuda.include_dirs[0]: src/toy.cu is not a directory"),
    (lambda d: d["kernels"][0]["cuda"].update(archs=["sm90"]), "cuda.archs[0]: 'sm90' is not an arch like sm_90"),
    (lambda d: d["kernels"][0]["cuda"].update(sources=[]), "cuda.sources: expected a non-empty list"),
    (lambda d: d["kernels"][0]["metal"].update(std="metal99"), "metal.std: 'metal99' is not a Metal language standard"),
    (lambda d: d["kernels"][0]["metal"].update(macos_min=14.0), "metal.macos_min: expected a quoted version string"),
    (lambda d: d["kernels"][0].update(entries={"float64": "x"}), "entries: 'float64' is not one of"),
    (lambda d: d["kernels"][0].update(entries={"float32": "1bad"}), "entries.float32: '1bad' is not a C identifier"),
    (lambda d: d["kernels"][0].update(requires=["attention.__class__ == 1"]),
     "attribute access is only allowed on rope"),
    (lambda d: d["kernels"][0].update(requires=["__import__('os')"]), "function calls are not allowed"),
    (lambda d: d["kernels"][0].update(requires=["unknown_name > 1"]), "unknown name 'unknown_name'"),
    (lambda d: d["kernels"][0].update(requires=["rope.__dict__"]), "unknown attribute rope.__dict__"),
    (lambda d: d["kernels"][0].update(requires=["[x for x in ()]"]), "ListComp is not allowed"),
    (lambda d: d["kernels"][0].update(requires=["head_dim ="]), "not a valid expression"),
    (lambda d: d["kernels"][0].update(requires=[{"expr": "head_dim > 0", "reason": "{rope.__class__}"}]),
     "reason placeholder {rope.__class__} must be a plain context name"),
    (lambda d: d["kernels"][0].update(requires="head_dim > 0"), "requires: expected a list"),
    (lambda d: d["kernels"][0]["signature"]["buffers"].append({"name": "z", "role": "output"}),
     "signature.buffers[3]: an output needs `like: <input>`"),
    (lambda d: d["kernels"][0]["signature"]["buffers"].append({"name": "x", "role": "input"}),
     "duplicate buffer name 'x'"),
    (lambda d: d["kernels"][0]["signature"]["buffers"].append({"name": "w", "role": "scratch"}),
     "signature.buffers[3].role: 'scratch' is not one of input, output, inplace"),
    (lambda d: d["kernels"][0]["signature"]["buffers"].append({"name": "w", "role": "inplace", "dtype": "uint8"}),
     "signature.buffers[3].dtype: 'uint8' is not one of float16, bfloat16, float32, int32, uint32"),
    (lambda d: d["kernels"][0].update(requires=["kv_bits in (4, 8) and kv_bitz == 4"]), "unknown name 'kv_bitz'"),
    (lambda d: d["kernels"][0]["signature"]["scalars"].append({"name": "m", "type": "int64"}),
     "signature.scalars[2].type: 'int64' is not one of int32, float32"),
    (lambda d: d["kernels"][0].update(signature={"buffers": [{"name": "x", "role": "input"}]}),
     "a kernel needs at least one output or inplace buffer"),
    (lambda d: [d["kernels"][0].pop(t) for t in ("cuda", "metal", "cpu")], "declares no backend"),
    (lambda d: d["kernels"].append(copy.deepcopy(d["kernels"][0])), "duplicate kernel name"),
    (lambda d: d["kernels"].append(dict(copy.deepcopy(d["kernels"][0]), name="toy2")),
     "kernel_attr: 'toy' is already filled by kernel 'toy'"),
    (lambda d: d["kernels"][0].update(kernel_attr="explain"), "kernel_attr: 'explain' is reserved"),
    (lambda d: d.update(schema_version=2), "schema_version: 2 is not supported"),
    (lambda d: d.update(kernels={"a": 1}), "kernels: expected a list"),
    (lambda d: d.update(extra=1), "unknown key 'extra'"),
    # `$` also matches before a trailing newline: "toy\n" is no identifier
    (lambda d: d["kernels"][0].update(name="toy\n"), "name: 'toy\\n' is not an identifier"),
    (lambda d: d["kernels"][0].update(kernel_attr="toy\n"), "kernel_attr: 'toy\\n' is not a public identifier"),
    (lambda d: d["kernels"][0]["enable"].update(env="MLX_AOT_TOY\n"), "enable.env: 'MLX_AOT_TOY\\n' is not"),
    (lambda d: d["kernels"][0].update(entries={"float32": "toy_f32\n"}), "entries.float32: 'toy_f32\\n' is not a C"),
    (lambda d: d["kernels"][0]["cuda"].update(archs=["sm_90\n"]), "cuda.archs[0]: 'sm_90\\n' is not an arch"),
    (lambda d: d["kernels"][0]["cuda"].update(archs=[["sm_90"], {"a": 1}]),
     "cuda.archs[0]: a list of 1 item is not an arch like sm_90"),
    (lambda d: d["kernels"][0].update(signature=None), "kernels.yaml:14: kernel 'toy': signature: expected a mapping"),
    (lambda d: d["kernels"][0].update(cpu="src/toy.cpp"), "kernels.yaml:45: kernel 'toy': cpu: expected a mapping"),
])
def test_bad_manifests_name_the_field(tmp_path, mutate, expected):
    text = problems(tmp_path, mutate)
    assert expected in text
    assert text.startswith("kernels.yaml:")
    assert not re.search(r"^kernels\.yaml:0:", text, re.M)   # every problem names its line


def test_errors_carry_line_numbers_and_all_problems(tmp_path):
    data = copy.deepcopy(GOOD)
    data["kernels"][0]["cuda"]["sources"] = ["src/missing.cu"]
    data["kernels"][0]["colour"] = "red"
    path = write(tmp_path, data)
    with pytest.raises(ManifestError) as e:
        load_manifest(path)
    assert len(e.value.problems) == 2
    lines = path.read_text().splitlines()
    for problem in e.value.problems:
        line = int(problem.split(":")[1])
        assert ("colour" in lines[line - 1]) or ("sources" in lines[line - 1] or "missing" in lines[line - 1])


def test_a_null_key_is_reported_at_its_own_line(tmp_path):
    """A key spelt `null` (None in Python) names its own line and reads `null`, not the mapping's line."""
    data = copy.deepcopy(GOOD)
    data["kernels"][0][None] = 3                       # the kernel mapping's last key
    data["kernels"][0]["entries"][None] = "toy_x"      # entries' last key
    path = write(tmp_path, data)
    with pytest.raises(ManifestError) as e:
        load_manifest(path)
    lines = path.read_text().splitlines()
    assert len(e.value.problems) == 2, e.value.problems
    for problem in e.value.problems:
        assert "null" in problem and "None" not in problem, problem
        assert lines[int(problem.split(":")[1]) - 1].lstrip().startswith("null:"), problem


def test_duplicate_yaml_keys_are_rejected(tmp_path):
    text = yaml.safe_dump(GOOD, sort_keys=False).replace("kernel_attr: toy\n", "kernel_attr: toy\n  kernel_attr: toy\n")
    with pytest.raises(ManifestError, match=r"kernels.yaml:\d+: .*duplicate key 'kernel_attr'"):
        load_manifest(write(tmp_path, text=text))


def test_python_tags_are_not_executed(tmp_path):
    text = "schema_version: 1\nkernels: !!python/object/apply:os.system ['echo pwned']\n"
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(write(tmp_path, text=text))


@pytest.mark.parametrize("text, expected", [
    ("", "expected a mapping"),
    ("[1, 2]", "expected a mapping"),
    ("kernels: [\n", "not valid YAML"),
    ("schema_version: 1\n", "missing required key 'kernels'"),
    ("schema_version: 1\nkernels: [3]\n", "kernels[0]: expected a mapping, got an integer"),
])
def test_junk_documents(tmp_path, text, expected):
    with pytest.raises(ManifestError, match=re.escape(expected)):
        load_manifest(write(tmp_path, text=text))


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="manifest not found"):
        load_manifest(tmp_path / "nope.yaml")


def test_validate_command_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "build_tools", "validate"], cwd=PROJECT_ROOT,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    data = copy.deepcopy(GOOD)
    data["kernels"][0]["colour"] = "red"
    bad = subprocess.run([sys.executable, "-m", "build_tools", "validate", "--manifest",
                          str(write(tmp_path, data))], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "unknown key 'colour'" in bad.stdout + bad.stderr
