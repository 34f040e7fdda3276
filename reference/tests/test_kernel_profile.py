"""scripts/kernel_profile.py: ncu's details and SASS source pages summed per kernel."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "scripts" / "kernel_profile.py")
kernel_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_profile)

DETAILS_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
                  '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name",'
                  '"Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"')


def metric(i, kernel, name, unit, value):
    return (f'"{i}","1","k3serve","h","{kernel}","1","13","(256, 1, 1)","(264, 1, 1)","0","9.0",'
            f'"Section","{name}","{unit}","{value}",""')


def rule(i, kernel, text):
    return (f'"{i}","1","k3serve","h","{kernel}","1","13","(256, 1, 1)","(264, 1, 1)","0","9.0",'
            f'"Compute Workload Analysis","","","","HighPipeUtilization","OPT","{text}","global","0"')


def test_details_per_launch(tmp_path):
    p = tmp_path / "details.csv"
    p.write_text("\n".join([
        "==PROF== Disconnected", DETAILS_HEADER,
        metric(0, "up_f32", "Duration", "us", "603.36"),
        metric(0, "up_f32", "Memory Throughput", "%", "59.79"),
        metric(0, "up_f32", "Memory Throughput", "Tbyte/s", "2.60"),  # the second of a name is ignored
        rule(0, "up_f32", "ALU is the highest-utilized pipeline (64.5%) based on elapsed cycles."),
        metric(1, "down_f32", "Issue Slots Busy", "%", "65.32"),
    ]) + "\n")
    got = kernel_profile.details(p)
    assert got[("0", "up_f32")] == {"Duration": "603.36 us", "Memory Throughput": "59.79 %",
                                    "pipeline": "ALU 64.5 %"}
    assert got[("1", "down_f32")] == {"Issue Slots Busy": "65.32 %"}
    assert list(kernel_profile.details(p, kernel="down")) == [("1", "down_f32")]


SOURCE_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
                 '"Instructions Executed","stall_wait","stall_math","stall_wait (Not Issued)"')


def sass(addr, src, samples, n, wait, math):
    return f'"{addr}","      {src}","{samples}","0","{n}","{wait}","{math}","99"'


def test_source_opcodes_stalls_and_loop_bodies(tmp_path):
    p = tmp_path / "source.csv"
    p.write_text("\n".join([
        '"Kernel Name","up_f32",', SOURCE_HEADER,
        sass("0x0", "LDC R1, c[0x0][0x28]", 1, 2112, 1, 0),
        sass("0x10", "@!P0 LOP3.LUT R14, R20, 0x80008000, RZ, 0xc0, !PT", 6, 688128, 2, 4),
        sass("0x20", "HMUL2.BF16_V2 R26, R26, R79", 3, 688128, 0, 3),
        sass("0x30", "@P1 BRA 0x7f00", 0, 0, 0, 0),
        '"Kernel Name","down_f32",', SOURCE_HEADER,
        sass("0x0", "LOP3.LUT R1, R2, 0x7, RZ, 0xc0, !PT", 2, 10, 2, 0),
    ]) + "\n")
    kernels = kernel_profile.sass_kernels(p)
    assert [k for k, _ in kernels] == ["up_f32", "down_f32"]
    total, ops, stalls, samples, bodies = kernel_profile.summarize_sass(kernels[0][1])
    assert total == 2112 + 2 * 688128
    assert ops["LOP3"] == 688128 and ops["HMUL2"] == 688128 and ops["LDC"] == 2112
    assert samples == 10
    assert stalls == {"wait": 3, "math": 7}  # the "(Not Issued)" column is not added in
    assert bodies == {688128: 2, 2112: 1}  # never-executed instructions are no loop body
    assert kernel_profile.opcode("@!UP2 ISETP.GE.AND P0, PT, R1, R2, PT") == "ISETP"
