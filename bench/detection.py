"""Detection (SSD) pipeline and codec benchmark (see gpuio/_bench/detection.py): ``python bench/detection.py --help``."""

from gpuio._bench.detection import main

if __name__ == "__main__":
    main()
