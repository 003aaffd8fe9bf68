// Runs the reference's Wan transformer (stable-diffusion.cpp 97d29908, `WAN::WanRunner`) once
// on a synthetic Wan file with the inputs of `models::diffusion::wan::tests::
// synthetic_wan21_files_load_and_run` (the same xorshift pattern as `testutil::pattern`) and
// writes its raw f32 output, which that test compares bit for bit when `SD_WAN_REF_OUT`
// names the folder. Not part of the build. Against a reference build in $REF (source in
// $REF/source, library in $REF/build/bin):
//
//   S=$REF/source; c++ -DGGML_MAX_NAME=160 -DGGML_USE_CPU -I$S -I$S/src -I$S/include \
//     -I$S/src/core -I$S/thirdparty -I$S/ggml/include -include $REF/sd-bench-stubs.h -O2 \
//     -std=gnu++17 tests/tools/wan_dit_ref.cpp -o wan_dit_ref -L$REF/build/bin \
//     -lstable-diffusion -Wl,-rpath,$REF/build/bin
//   F=~/.cache/sd-rs-fixtures; O=/tmp/wanref
//   ./wan_dit_ref $F/wan21_t2v.safetensors t2v $O/t2v.bin        (also: frames)
//   ./wan_dit_ref $F/wan21_t2v_prefixed.safetensors t2v $O/t2v_prefixed.bin
//   ./wan_dit_ref $F/wan21_i2v.safetensors i2v $O/i2v.bin
//   ./wan_dit_ref $F/wan21_flf2v.safetensors flf $O/flf.bin      (`i2v` there aborts: 257 tokens)
//   ./wan_dit_ref $F/wan21_vace.safetensors vace $O/vace.bin
//   SD_MODEL_TESTS=1 SD_WAN_REF_OUT=$O cargo test --release --lib wan::tests::synthetic
#include "model/diffusion/wan.hpp"
#include <cstdio>
#include <cstdlib>

static std::vector<float> pattern(size_t n, uint32_t seed) {
    uint32_t state = seed * 2654435761u + 1u;
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        v[i] = (float)(state % 2001) / 1000.0f - 1.0f;
    }
    return v;
}

static sd::Tensor<float> tensor(std::vector<int64_t> shape, uint32_t seed, float scale = 1.f) {
    size_t n = 1;
    for (auto d : shape) n *= d;
    auto v = pattern(n, seed);
    for (auto& x : v) x *= scale;
    return sd::Tensor<float>(shape, v);
}

int main(int argc, char** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: harness FILE CASE OUT\n");
        return 2;
    }
    std::string path = argv[1], kase = argv[2], out_path = argv[3];
    ggml_backend_t backend = sd_backend_cpu_init();
    auto mm = std::make_shared<ModelManager>();
    if (!mm->loader().init_from_file_and_convert_name(path, "model.diffusion_model.")) {
        fprintf(stderr, "load failed\n");
        return 1;
    }
    auto& storage = mm->loader().get_tensor_storage_map();
    auto wan = std::make_shared<WAN::WanRunner>(backend, storage, "model.diffusion_model", VERSION_WAN2, mm);
    if (!mm->register_runner_params("wan", *wan, "model.diffusion_model", ModelManager::ResidencyMode::ParamBackend, backend, backend) ||
        !mm->validate_registered_tensors()) {
        fprintf(stderr, "register failed\n");
        return 1;
    }
    auto x       = tensor({8, 8, 2, 16, 1}, 22);
    auto context = tensor({4096, 512, 1}, 21);
    std::vector<float> ts = {750.f};
    sd::Tensor<float> clip, concat, vace;
    if (kase == "frames") ts = {750.f, 300.f};
    if (kase == "i2v") {
        concat = tensor({8, 8, 2, 20, 1}, 23);
        clip   = tensor({1280, 257, 1}, 24, 4.f);
    }
    if (kase == "flf") {
        concat = tensor({8, 8, 2, 20, 1}, 23);
        clip   = tensor({1280, 514, 1}, 24, 4.f);
    }
    if (kase == "vace") vace = tensor({8, 8, 2, 96, 1}, 25);
    sd::Tensor<float> timesteps({(int64_t)ts.size()}, ts);
    int64_t t0 = ggml_time_ms();
    auto out = wan->compute(2, x, timesteps, context, clip, concat, {}, vace, 1.f);
    int64_t t1 = ggml_time_ms();
    fprintf(stderr, "forward %lld ms, %lld values\n", (long long)(t1 - t0), (long long)out.numel());
    FILE* f = fopen(out_path.c_str(), "wb");
    fwrite(out.data(), sizeof(float), out.numel(), f);
    fclose(f);
    return 0;
}
