"""``make ptx-check``: every kernel of the CUDA engine (a round of Int6, Int8 and Int16
training, both losses, the FedProx term, the fleet's gather) compiled to PTX for compute
capabilities 5.3 (Jetson Nano), 7.2 (Xavier), 8.7 (Orin) and 9.0 (H100) without a GPU:
numba-cuda's compiler with CUDA 12's NVVM. Prints one line per capability; exit 1 when
a kernel does not compile."""

from __future__ import annotations

import sys
import time

CCS = ((5, 3), (7, 2), (8, 7), (9, 0))


def main() -> int:
    from edge_client.intnn.cuda.compile import compile_engine

    t0 = time.perf_counter()
    try:
        record = compile_engine(CCS)
    except Exception as exc:  # noqa: BLE001 - the compiler's error is the verdict
        print(f"ptx-check: a kernel does not compile: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for cc in CCS:
        mine = {k: v for k, v in record.items() if k[2] == cc}
        names = sorted({k[0] for k in mine})
        print(f"sm_{cc[0]}{cc[1]}: {len(mine)} kernel variants compiled ({len(names)} kernels: {', '.join(names)})")
    print(f"ptx-check: {len(record)} compilations in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
