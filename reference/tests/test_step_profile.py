"""scripts/step_profile.py: ncu's CSV cut into decode steps and summed per kernel."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("step_profile", ROOT / "scripts" / "step_profile.py")
step_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_profile)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i, name, value, unit="ns"):
    return (f'"{i}","1","k3serve","h","{name}","1","13","(256, 1, 1)","(1, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def write(tmp_path, kernels):
    lines = ["==PROF== Connected to process 1", HEADER]
    lines += [row(i, n, v, *u) for i, (n, v, *u) in enumerate(kernels)]
    p = tmp_path / "times.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_steps_and_units(tmp_path):
    prefill = [("embed_rows_bf16", "9,000"), ("topk_merge_f32", "1,000")]
    small = [("rms_norm_f32", "3,500"), ("void cutlass::Kernel2<x>(T1::Params)", "10"), ("topk_merge_f32", "1,000")]
    big = [("rms_norm_f32", "4,000"), ("rms_norm_f32", "4,000"), ("attn_res_f32", "0.012", "ms"),
           ("topk_merge_f32", "1,000")]
    p = write(tmp_path, prefill + small * 3 + prefill + big * 2)
    got = list(step_profile.kernels(p))
    assert got[0] == ("embed_rows_bf16", 9.0, None)  # (name, µs, DRAM bytes: none in this CSV)
    assert ("attn_res_f32", 12.0, None) in got
    segs = list(step_profile.steps(got))
    assert [len(s) for s in segs] == [2, 3, 3, 3, 2, 4, 4]
    assert step_profile.short("void cutlass::Kernel2<x>(T1::Params)").startswith("cuBLAS")


def test_report(tmp_path, capsys, monkeypatch):
    prefill = [("embed_rows_bf16", "9,000"), ("topk_merge_f32", "1,000")]
    step = [("rms_norm_f32", "2,000"), ("rms_norm_f32", "2,000"), ("topk_merge_f32", "1,000")]
    p = write(tmp_path, prefill + step * 2)
    monkeypatch.setattr("sys.argv", ["step_profile.py", str(p)])
    step_profile.main()
    out = capsys.readouterr().out
    assert "decode run 1: 3 kernels, 0.01 ms" in out
    assert "4.0 us   80.0 %     2 x  rms_norm_f32" in out


def test_dram_bytes_give_each_kernels_rate(tmp_path, capsys, monkeypatch):
    # device-step-profile.sh with K3_STEP_BYTES=1: read and write bytes rows beside each kernel's time.
    lines = ["==PROF== Connected to process 1", HEADER]
    prefill = [("embed_rows_bf16", 9000), ("topk_merge_f32", 1000)]
    kernels = prefill + [("gemm_f32", 50_000), ("topk_merge_f32", 1000)] * 2
    for i, (name, ns) in enumerate(kernels):
        lines.append(row(i, name, ns))
        for metric, mb in (("dram__bytes_read.sum", 150.0), ("dram__bytes_write.sum", 25.0)):
            lines.append(row(i, name, mb).replace("gpu__time_duration.sum", metric).replace('"ns"', '"Mbyte"'))
    p = tmp_path / "times.csv"
    p.write_text("\n".join(lines) + "\n")
    got = list(step_profile.kernels(p))
    assert got[2] == ("gemm_f32", 50.0, 175e6)
    monkeypatch.setattr("sys.argv", ["step_profile.py", str(p), "--each", "20"])
    step_profile.main()
    out = capsys.readouterr().out
    assert "50.0 us   98.0 %     1 x   3.50 TB/s  gemm_f32" in out  # 175 MB in 50 µs
    assert "175.0 MB  3.50 TB/s  gemm_f32" in out  # the --each listing
    assert "topk_merge_f32" not in out.split("gemm_f32")[-1]  # 1 µs kernels are not listed one by one


def test_empty_csv_is_an_error(tmp_path):
    p = tmp_path / "times.csv"
    p.write_text("==PROF== Connected to process 1\n")
    try:
        list(step_profile.kernels(p))
    except SystemExit as e:
        assert "no kernel rows" in str(e)
    else:
        raise AssertionError("an empty CSV must not pass")
