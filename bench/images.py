"""Image pipeline benchmark (see gpuio/_bench/images.py): ``python bench/images.py --help``."""

from gpuio._bench.images import main

if __name__ == "__main__":
    main()
