"""Storage benchmark (see gpuio/_bench/storage.py): ``python bench/storage.py --help``."""

from gpuio._bench.storage import main

if __name__ == "__main__":
    main()
