"""Stage "probe" of the device check, in its own process (an illegal address would poison
the CUDA context of every later call): ``verify_moe`` on DeepSeek-V3's TP1 layer (E = 256,
I = 2048, H = 7168: w13 has E x 2I x H = 7.5e9 elements, past 2^31), tokens routed to the
first and the last experts, against the reference. With 32-bit offsets the last experts'
weights would be read from a wrapped address. Only the experts in use are filled; the rest
of the 22 GB stays uninitialised. A dry run checks the offset arithmetic at that shape under
Triton's interpreter (test/ops/test_verify_moe.py's check) instead. Writes probe.json."""

import common
import torch

from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference

HIDDEN, INTER, EXPERTS = 7168, 2048, 256
ROUTES = [[0, 255, 254, 1], [255, 128, 127, 253], [200, 255, 3, 100]]


def probe_gpu(record, device):
    w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16, device=device)
    ids = torch.tensor(ROUTES, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for e in ids.unique().tolist():
        w13[e].normal_(generator=gen).mul_(HIDDEN**-0.5)
        w2[e].normal_(generator=gen).mul_(INTER**-0.5)
    x = torch.randn(len(ROUTES), HIDDEN, device=device, generator=gen).to(torch.bfloat16)
    weights = torch.rand(ids.shape, device=device, generator=gen)
    out, step = verify_moe(x, w13, w2, ids, weights, impl="triton")
    ref, ref_step = verify_moe_reference(x, w13, w2, ids, weights)
    torch.cuda.synchronize()
    error = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    ok = error <= 2e-2 and bool(torch.equal(step, ref_step))
    row = dict(elements_w13=w13.numel(), last_expert_offset=255 * 2 * INTER * HIDDEN)
    row.update(rel_error=error, bitmap_ok=bool(torch.equal(step, ref_step)), ok=ok)
    record.add(row, ok=ok, failure=f"verify_moe past 2^31 elements differs: {row}")
    print(f"probe: w13 {w13.numel():.3e} elements, rel. error {error:.1e}, ok={ok}")


def probe_interpreter(record):
    common.use_test_helpers()
    from test_verify_moe import check_offsets_are_64_bit

    check_offsets_are_64_bit()
    record.add(dict(check="expert_tile_offsets at E=256, 2I=4096, H=7168 (interpreter)", ok=True))
    print("probe: 64-bit offsets at DeepSeek-V3's TP1 shape (interpreter)")


def main(argv=None) -> int:
    args = common.parse_args(__doc__.splitlines()[0], argv)
    device = common.stage_device(args.dry_run)
    record = common.StageRecord(args.out, "probe", args.dry_run)
    if args.dry_run:
        probe_interpreter(record)
    else:
        probe_gpu(record, device)
    return record.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
