"""`python -m bench [options]` measures speed, memory and agreement (bench/speed.py);
`python -m bench convergence [options]` trains on real data (bench/convergence.py);
`python -m bench distributed [options]` runs K-FAC's KAISA strategies on 1 and 2 CPU ranks
(bench/distributed.py); `python -m bench fsdp-bytes [options]` counts the gradient bytes K-FAC
and SINGD move under FSDP2 (bench/fsdp_bytes.py); `python -m bench proxies [options]` reports the
CPU proxies of the GPU targets: host time, launches, gated not-due work, scratch
(bench/proxies.py)."""
import sys


def main(argv: list[str]) -> int:
    if argv and argv[0] == "convergence":
        from .convergence import main as convergence_main
        return convergence_main(argv[1:])
    if argv and argv[0] == "distributed":
        from .distributed import main as distributed_main
        return distributed_main(argv[1:])
    if argv and argv[0] == "fsdp-bytes":
        from .fsdp_bytes import main as fsdp_bytes_main
        return fsdp_bytes_main(argv[1:])
    if argv and argv[0] == "proxies":
        from .proxies import main as proxies_main
        return proxies_main(argv[1:])
    from .speed import main as speed_main
    return speed_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
