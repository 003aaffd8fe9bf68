// Runs the reference's LTX-2.3 audio VAE and vocoder (stable-diffusion.cpp 97d29908,
// `LTXV::LTXAudioVAERunner`) once on a synthetic audio VAE file with the latent of
// `pipeline::families::ltx::tests::the_audio_vae_decodes_as_the_reference` (16 bins x 15 steps
// x 8 channels of the xorshift pattern of `testutil::pattern`, seed 31) and writes its raw f32
// waveform [samples, 2] (planar), which that test compares when `SD_LTX_AUDIO_REF_OUT` names
// the folder. Not part of the build. Against a reference build in $REF (source in
// $REF/source, library in $REF/build/bin):
//
//   S=$REF/source; c++ -DGGML_MAX_NAME=160 -DGGML_USE_CPU -I$S -I$S/src -I$S/include \
//     -I$S/src/core -I$S/thirdparty -I$S/ggml/include -include $REF/sd-bench-stubs.h -O2 \
//     -std=gnu++17 tests/tools/ltx_audio_ref.cpp -o ltx_audio_ref -L$REF/build/bin \
//     -lstable-diffusion -Wl,-rpath,$REF/build/bin
//   F=~/.cache/sd-rs-fixtures; O=/tmp/ltxaudioref
//   ./ltx_audio_ref $F/ltx_audio_vae.safetensors $O/ltx_audio_vae.bin
//   ./ltx_audio_ref $F/ltx_audio_vae_bwe.safetensors $O/ltx_audio_vae_bwe.bin
//   SD_LTX_AUDIO_REF_OUT=$O cargo test --release --lib the_audio_vae_decodes_as_the_reference
#include "model/vae/ltx_audio_vae.hpp"
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

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: ltx_audio_ref FILE OUT\n");
        return 2;
    }
    std::string path = argv[1], out_path = argv[2];
    ggml_backend_t backend = sd_backend_cpu_init();
    auto mm                = std::make_shared<ModelManager>();
    if (!mm->loader().init_from_file(path)) {
        fprintf(stderr, "load failed\n");
        return 1;
    }
    auto& storage = mm->loader().get_tensor_storage_map();
    auto vae      = std::make_shared<LTXV::LTXAudioVAERunner>(backend, storage, "", mm);
    if (!mm->register_runner_params("LTX audio VAE test", *vae, ModelManager::ResidencyMode::ParamBackend, backend, backend) ||
        !mm->validate_registered_tensors()) {
        fprintf(stderr, "register failed\n");
        return 1;
    }
    std::vector<int64_t> shape = {16, 15, 8, 1};
    sd::Tensor<float> z(shape, pattern(16 * 15 * 8, 31));
    auto out = vae->decode(2, z);
    fprintf(stderr, "%lld values, rate %d\n", (long long)out.numel(), vae->output_sample_rate());
    FILE* f = fopen(out_path.c_str(), "wb");
    fwrite(out.data(), sizeof(float), out.numel(), f);
    fclose(f);
    return 0;
}
