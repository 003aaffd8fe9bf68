// Calls every function of the installed stable-diffusion.h the way a C program would,
// including with hostile inputs, and checks the results. Built twice by run.sh (against
// the shared and the static library) and run under valgrind. Ends with "N passed, N failed".
#define _GNU_SOURCE
#include "stable-diffusion.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int passed, failed;

static void check(int ok, const char* file, int line, const char* fmt, ...) {
    if (ok) {
        passed++;
        return;
    }
    failed++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}
#define CHECK(cond, ...) check(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

// strcmp that takes a NULL result as a mismatch instead of crashing the test.
static int streq(const char* a, const char* b) {
    return a != NULL && b != NULL && strcmp(a, b) == 0;
}
static const char* show(const char* s) {
    return s ? s : "(null)";
}

#include "abi_expected.h"

// ---------------------------------------------------------------------------- callbacks

static int log_count, log_errors;
static char last_error[512];

static void on_log(enum sd_log_level_t level, const char* text, void* data) {
    CHECK(data == &log_count, "log callback: user data not passed through");
    CHECK(text != NULL, "log callback: NULL text");
    CHECK(level <= SD_LOG_ERROR, "log callback: level %d", (int)level);
    log_count++;
    if (level == SD_LOG_ERROR && text) {
        log_errors++;
        snprintf(last_error, sizeof(last_error), "%s", text);
    }
    if (getenv("SD_TEST_VERBOSE")) fprintf(stderr, "[log %d] %s", (int)level, text ? text : "(null)\n");
}

static void on_progress(int step, int steps, float time, void* data) {
    (void)step, (void)steps, (void)time, (void)data;
}
static void on_preview(int step, int n, sd_image_t* frames, bool noisy, void* data) {
    (void)step, (void)n, (void)frames, (void)noisy, (void)data;
}
static bool on_eval(struct ggml_tensor* t, bool ask, void* data) {
    (void)t, (void)ask, (void)data;
    return true;
}

static void test_callbacks(void) {
    sd_set_progress_callback(on_progress, NULL);
    sd_set_preview_callback(on_preview, PREVIEW_PROJ, 1, true, false, NULL);
    sd_set_backend_eval_callback(on_eval, NULL);
    // hostile: out-of-range preview mode, zero/negative interval
    sd_set_preview_callback(on_preview, (enum preview_t)9999, -5, false, true, NULL);
    sd_set_progress_callback(NULL, NULL);
    sd_set_preview_callback(NULL, PREVIEW_NONE, 0, false, false, NULL);
    sd_set_backend_eval_callback(NULL, NULL);
}

// ---------------------------------------------------------------------------- facts

static void test_facts(void) {
    const char* v = sd_version();
    const char* c = sd_commit();
    CHECK(v && *v, "sd_version empty");
    CHECK(c && *c, "sd_commit empty");
    CHECK(sd_version() == v, "sd_version: not a static string");
    const char* info = sd_get_system_info();
    CHECK(info && strncmp(info, "System Info:", 12) == 0, "sd_get_system_info: %s", show(info));
    CHECK(sd_get_num_physical_cores() >= 1, "sd_get_num_physical_cores = %d", sd_get_num_physical_cores());
}

static void test_list_devices(void) {
    size_t need = sd_list_devices(NULL, 0);
    CHECK(need > 0, "sd_list_devices(NULL, 0) = %zu", need);
    CHECK(sd_list_devices(NULL, 100) == need, "sd_list_devices(NULL, 100)");

    char sentinel[8];
    memset(sentinel, 'x', sizeof(sentinel));
    CHECK(sd_list_devices(sentinel, 0) == need, "sd_list_devices(buf, 0)");
    CHECK(sentinel[0] == 'x', "sd_list_devices wrote into a 0-byte buffer");

    char one[1] = {'x'};
    CHECK(sd_list_devices(one, 1) == need && one[0] == '\0', "sd_list_devices(buf, 1)");

    char shortbuf[6];
    memset(shortbuf, 'x', sizeof(shortbuf));
    CHECK(sd_list_devices(shortbuf, 5) == need, "sd_list_devices(short)");
    CHECK(strlen(shortbuf) == (need < 4 ? need : 4), "short buffer: %zu bytes", strlen(shortbuf));
    CHECK(shortbuf[5] == 'x', "sd_list_devices wrote past the buffer");

    char* full = malloc(need + 64);
    memset(full, 'x', need + 64);
    CHECK(sd_list_devices(full, need + 1) == need, "sd_list_devices(exact)");
    CHECK(strlen(full) == need && full[need + 1] == 'x', "exact buffer");
    CHECK(strncmp(full, shortbuf, strlen(shortbuf)) == 0, "short listing is a prefix of the full one");
    CHECK(full[need - 1] == '\n', "listing ends with a newline");
    CHECK(strncmp(full, "CPU\t", 4) == 0 || strstr(full, "\nCPU\t") != NULL, "no CPU device in: %s", full);
    for (char* line = full; *line; line = strchr(line, '\n') + 1) {
        char* tab = strchr(line, '\t');
        char* nl = strchr(line, '\n');
        CHECK(nl && tab && tab < nl, "device line without name<TAB>description");
        if (!nl) break;
    }
    memset(full, 'x', need + 64);
    CHECK(sd_list_devices(full, need + 64) == need && strlen(full) == need, "sd_list_devices(long)");
    free(full);
}

// ---------------------------------------------------------------------------- names

// Every declared value has a name that parses back to it; anything else is "NONE";
// unknown, empty and NULL texts parse as the COUNT value.
#define CHECK_NAMES(name_fn, parse_fn, type, count)                                              \
    do {                                                                                          \
        const int* values = sd_abi_values_##type;                                                 \
        for (size_t k = 0; k < sizeof(sd_abi_values_##type) / sizeof(int); k++) {                 \
            int i = values[k];                                                                    \
            const char* n = name_fn((enum type)i);                                                \
            CHECK(n && *n && !streq(n, "NONE"), #name_fn "(%d) = %s", i, show(n));                \
            if (n) CHECK((int)parse_fn(n) == i, #parse_fn "(\"%s\") = %d, want %d", n, (int)parse_fn(n), i); \
        }                                                                                         \
        CHECK(streq(name_fn((enum type)(count)), "NONE"), #name_fn "(COUNT)");                    \
        CHECK(streq(name_fn((enum type)9999), "NONE"), #name_fn "(9999)");                        \
        CHECK(streq(name_fn((enum type)-1), "NONE"), #name_fn "(-1)");                            \
        CHECK((int)parse_fn("no-such-name") == (int)(count), #parse_fn "(unknown)");              \
        CHECK((int)parse_fn("") == (int)(count), #parse_fn "(\"\")");                             \
        CHECK((int)parse_fn(NULL) == (int)(count), #parse_fn "(NULL)");                           \
    } while (0)

static void test_names(void) {
    CHECK_NAMES(sd_type_name, str_to_sd_type, sd_type_t, SD_TYPE_COUNT);
    CHECK_NAMES(sd_rng_type_name, str_to_rng_type, rng_type_t, RNG_TYPE_COUNT);
    CHECK_NAMES(sd_sample_method_name, str_to_sample_method, sample_method_t, SAMPLE_METHOD_COUNT);
    CHECK_NAMES(sd_scheduler_name, str_to_scheduler, scheduler_t, SCHEDULER_COUNT);
    CHECK_NAMES(sd_prediction_name, str_to_prediction, prediction_t, PREDICTION_COUNT);
    CHECK_NAMES(sd_preview_name, str_to_preview, preview_t, PREVIEW_COUNT);
    CHECK_NAMES(sd_lora_apply_mode_name, str_to_lora_apply_mode, lora_apply_mode_t, LORA_APPLY_MODE_COUNT);
    CHECK_NAMES(sd_hires_upscaler_name, str_to_sd_hires_upscaler, sd_hires_upscaler_t, SD_HIRES_UPSCALER_COUNT);
    CHECK(streq(sd_sample_method_name(EULER_A_SAMPLE_METHOD), "euler_a"), "euler_a");
    CHECK(streq(sd_type_name(SD_TYPE_Q8_0), "q8_0"), "q8_0");
    CHECK(str_to_sd_type("Q8_0") == SD_TYPE_COUNT, "names are case-sensitive");

    for (int i = 0; i < SAMPLE_METHOD_COUNT; i++)
        CHECK(streq(sample_method_to_str[i], sd_sample_method_name((enum sample_method_t)i)),
              "sample_method_to_str[%d] = %s", i, show(sample_method_to_str[i]));
    for (int i = 0; i < SCHEDULER_COUNT; i++)
        CHECK(streq(scheduler_to_str[i], sd_scheduler_name((enum scheduler_t)i)),
              "scheduler_to_str[%d] = %s", i, show(scheduler_to_str[i]));
}

// ---------------------------------------------------------------------------- params

static void test_params(void) {
    check_init_defaults();

    sd_ctx_params_t cp;
    sd_ctx_params_init(&cp);
    cp.model_path = "model.safetensors";
    char* s = sd_ctx_params_to_str(&cp);
    CHECK(s && strstr(s, "model.safetensors"), "sd_ctx_params_to_str");
    free(s);

    sd_sample_params_t sp;
    sd_sample_params_init(&sp);
    s = sd_sample_params_to_str(&sp);
    CHECK(s && *s, "sd_sample_params_to_str");
    free(s);

    sd_img_gen_params_t ip;
    sd_img_gen_params_init(&ip);
    ip.prompt = "a lovely cat";
    s = sd_img_gen_params_to_str(&ip);
    CHECK(s && strstr(s, "a lovely cat"), "sd_img_gen_params_to_str");
    free(s);

    // hostile: out-of-range enums, garbage counts with NULL arrays, NULL params
    cp.wtype = (enum sd_type_t)9999;
    cp.rng_type = (enum rng_type_t)77;
    cp.embedding_count = 1000;  // with embeddings == NULL
    s = sd_ctx_params_to_str(&cp);
    free(s);
    ip.sample_params.sample_method = (enum sample_method_t)12345;
    ip.lora_count = 5;  // with loras == NULL
    ip.ref_images_count = -3;
    s = sd_img_gen_params_to_str(&ip);
    free(s);
    free(sd_ctx_params_to_str(NULL));
    free(sd_sample_params_to_str(NULL));
    free(sd_img_gen_params_to_str(NULL));
    sd_ctx_params_init(NULL);
    sd_img_gen_params_init(NULL);
    sd_vid_gen_params_init(NULL);
    sd_sample_params_init(NULL);
    sd_cache_params_init(NULL);
    sd_hires_params_init(NULL);
}

// ---------------------------------------------------------------------------- images

static uint8_t* filled(size_t n, uint8_t v) {
    uint8_t* p = malloc(n);
    memset(p, v, n);
    return p;
}

static void test_free_images(void) {
    sd_image_t* imgs = malloc(3 * sizeof(sd_image_t));
    imgs[0] = (sd_image_t){4, 4, 3, filled(48, 1)};
    imgs[1] = (sd_image_t){2, 2, 1, NULL};
    imgs[2] = (sd_image_t){1, 1, 4, filled(4, 2)};
    free_sd_images(imgs, 3);
    free_sd_images(NULL, 0);
    free_sd_images(NULL, 12);
    free_sd_images(malloc(sizeof(sd_image_t)), 0);  // the array alone

    sd_audio_t* audio = malloc(sizeof(sd_audio_t));
    *audio = (sd_audio_t){16000, 1, 4, malloc(4 * sizeof(float))};
    free_sd_audio(audio);
    audio = malloc(sizeof(sd_audio_t));
    *audio = (sd_audio_t){0, 0, 0, NULL};
    free_sd_audio(audio);
    free_sd_audio(NULL);
}

static void test_canny(void) {
    enum { W = 32, H = 24, C = 3 };
    uint8_t* px = malloc(W * H * C);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            for (int c = 0; c < C; c++) px[(y * W + x) * C + c] = (x >= 8 && x < 24 && y >= 6 && y < 18) ? 255 : 0;
    sd_image_t img = {W, H, C, px};
    CHECK(preprocess_canny(img, 0.08f, 0.08f, 0.8f, 1.0f, false), "preprocess_canny failed");
    int edges = 0, binary = 1, gray = 1;
    for (int i = 0; i < W * H; i++) {
        uint8_t v = px[i * C];
        edges += v == 255;
        binary &= v == 0 || v == 255;
        gray &= px[i * C + 1] == v && px[i * C + 2] == v;
    }
    CHECK(edges > 0 && edges < W * H / 2, "canny: %d edge pixels", edges);
    CHECK(binary && gray, "canny output is a binary gray image");

    // single-channel input, inverse
    uint8_t* one = filled(W * H, 0);
    for (int y = 6; y < 18; y++) memset(one + y * W + 8, 255, 16);
    CHECK(preprocess_canny((sd_image_t){W, H, 1, one}, 0.08f, 0.08f, 0.8f, 1.0f, true), "canny 1 channel");
    CHECK(one[0] == 255, "inverse canny: background is white");

    // hostile: NULL data, zero sizes
    CHECK(!preprocess_canny((sd_image_t){W, H, C, NULL}, 0.08f, 0.08f, 0.8f, 1.0f, false), "canny NULL data");
    preprocess_canny((sd_image_t){0, 0, 3, px}, 0.08f, 0.08f, 0.8f, 1.0f, false);
    preprocess_canny((sd_image_t){1, 1, 3, px}, 0.08f, 0.08f, 0.8f, 1.0f, false);
    free(px);
    free(one);
}

// ---------------------------------------------------------------------------- imatrix

static char tmpdir[256];

static char* tmp_path(const char* name) {
    static char buf[4][512];
    static int i;
    char* p = buf[i++ % 4];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

static size_t write_file(const char* path, const void* data, size_t n) {
    FILE* f = fopen(path, "wb");
    if (!f) return 0;
    size_t w = fwrite(data, 1, n, f);
    fclose(f);
    return w;
}

static long read_file(const char* path, unsigned char* buf, size_t cap) {
    FILE* f = fopen(path, "rb");
    if (!f) return -1;
    long n = (long)fread(buf, 1, cap, f);
    fclose(f);
    return n;
}

static void test_imatrix(void) {
    // the reference's format: n_entries, then per entry len, name, ncall, nval, values; then last call
    unsigned char data[256];
    size_t n = 0;
    const char* name = "model.diffusion_model.out.2.weight";
    int n_entries = 1, len = (int)strlen(name), ncall = 1, nval = 4, last = 0;
    float values[4] = {0.5f, 1.0f, 2.0f, 4.0f};
#define PUT(v) (memcpy(data + n, &(v), sizeof(v)), n += sizeof(v))
    PUT(n_entries);
    PUT(len);
    memcpy(data + n, name, len), n += len;
    PUT(ncall);
    PUT(nval);
    PUT(values);
    PUT(last);
#undef PUT
    CHECK(write_file(tmp_path("in.dat"), data, n) == n, "write imatrix");
    enable_imatrix_collection();
    disable_imatrix_collection();
    CHECK(load_imatrix(tmp_path("in.dat")), "load_imatrix: %s", last_error);
    save_imatrix(tmp_path("out.dat"));
    unsigned char back[512];
    long got = read_file(tmp_path("out.dat"), back, sizeof(back));
    CHECK(got == (long)n && memcmp(back, data, n) == 0, "imatrix round trip: %ld bytes, want %zu", got, n);

    // hostile files
    CHECK(!load_imatrix(tmp_path("missing.dat")), "load_imatrix(missing)");
    CHECK(!load_imatrix(NULL), "load_imatrix(NULL)");
    CHECK(!load_imatrix(""), "load_imatrix(\"\")");
    int zero = 0;
    write_file(tmp_path("empty.dat"), &zero, sizeof(zero));
    CHECK(!load_imatrix(tmp_path("empty.dat")), "load_imatrix(no entries)");
    write_file(tmp_path("trunc.dat"), data, n / 2);
    CHECK(!load_imatrix(tmp_path("trunc.dat")), "load_imatrix(truncated)");
    int huge[3] = {1, 0x7fffffff, 0};
    write_file(tmp_path("huge.dat"), huge, sizeof(huge));
    CHECK(!load_imatrix(tmp_path("huge.dat")), "load_imatrix(huge name length)");
    int neg[3] = {1, -5, 0};
    write_file(tmp_path("neg.dat"), neg, sizeof(neg));
    CHECK(!load_imatrix(tmp_path("neg.dat")), "load_imatrix(negative name length)");
    save_imatrix(tmp_path("no/such/dir/out.dat"));  // must not crash
    save_imatrix(NULL);
}

// ---------------------------------------------------------------------------- failures

static int exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static void test_failures(void) {
    sd_image_t* out = (sd_image_t*)0x1;
    int n = 42;

    // contexts that cannot be made
    sd_ctx_params_t cp;
    sd_ctx_params_init(&cp);
    cp.n_threads = 1;
    int errors_before = log_errors;
    CHECK(new_sd_ctx(&cp) == NULL, "new_sd_ctx without any model");
    cp.model_path = tmp_path("no-such-model.safetensors");
    CHECK(new_sd_ctx(&cp) == NULL, "new_sd_ctx(missing model)");
    CHECK(log_errors > errors_before, "a failed new_sd_ctx logs an error");
    unsigned char junk[64];
    for (size_t i = 0; i < sizeof(junk); i++) junk[i] = (unsigned char)(i * 37 + 11);
    write_file(tmp_path("junk.safetensors"), junk, sizeof(junk));
    cp.model_path = tmp_path("junk.safetensors");
    CHECK(new_sd_ctx(&cp) == NULL, "new_sd_ctx(junk model)");
    unsigned long long hdr = 0xffffffffffffULL;  // safetensors header length far past the file
    write_file(tmp_path("hdr.safetensors"), &hdr, sizeof(hdr));
    cp.model_path = tmp_path("hdr.safetensors");
    CHECK(new_sd_ctx(&cp) == NULL, "new_sd_ctx(huge header length)");
    CHECK(new_sd_ctx(NULL) == NULL, "new_sd_ctx(NULL)");

    // functions on a NULL context
    sd_img_gen_params_t ip;
    sd_img_gen_params_init(&ip);
    ip.prompt = "a cat";
    CHECK(!generate_image(NULL, &ip, &out, &n), "generate_image(NULL ctx)");
    CHECK(out == NULL && n == 0, "generate_image clears its outputs on failure");
    CHECK(!generate_image(NULL, NULL, NULL, NULL), "generate_image(NULL...)");
    sd_vid_gen_params_t vp;
    sd_vid_gen_params_init(&vp);
    sd_audio_t* audio = NULL;
    out = NULL;
    n = 0;
    // (the reference returns before touching the outputs here, so they are not checked)
    CHECK(!generate_video(NULL, &vp, &out, &n, &audio), "generate_video(NULL ctx)");
    CHECK(!generate_video(NULL, NULL, NULL, NULL, NULL), "generate_video(NULL...)");
    CHECK(!sd_ctx_supports_image_generation(NULL), "supports_image_generation(NULL)");
    CHECK(!sd_ctx_supports_video_generation(NULL), "supports_video_generation(NULL)");
    CHECK(!sd_ctx_load_control_net(NULL, "x.safetensors"), "load_control_net(NULL)");
    CHECK(!sd_ctx_unload_control_net(NULL), "unload_control_net(NULL)");
    CHECK(!sd_ctx_has_control_net(NULL), "has_control_net(NULL)");
    CHECK(sd_get_default_sample_method(NULL) == EULER_A_SAMPLE_METHOD, "default sample method");
    CHECK(sd_get_default_scheduler(NULL, EULER_A_SAMPLE_METHOD) == DISCRETE_SCHEDULER, "default scheduler");
    CHECK(sd_get_default_scheduler(NULL, LCM_SAMPLE_METHOD) == LCM_SCHEDULER, "default scheduler (lcm)");
    CHECK(sd_get_default_scheduler(NULL, DDIM_TRAILING_SAMPLE_METHOD) == SIMPLE_SCHEDULER, "default scheduler (ddim)");
    sd_get_default_scheduler(NULL, (enum sample_method_t)9999);
    sd_cancel_generation(NULL, SD_CANCEL_ALL);
    sd_cancel_generation(NULL, SD_CANCEL_NEW_LATENTS);
    sd_cancel_generation(NULL, SD_CANCEL_RESET);
    sd_cancel_generation(NULL, (enum sd_cancel_mode_t)9999);
    free_sd_ctx(NULL);

    // upscaler
    CHECK(new_upscaler_ctx(tmp_path("no-such-esrgan.safetensors"), false, 1, 128, NULL, NULL) == NULL,
          "new_upscaler_ctx(missing)");
    CHECK(new_upscaler_ctx(tmp_path("junk.safetensors"), false, 1, 128, NULL, NULL) == NULL, "new_upscaler_ctx(junk)");
    CHECK(new_upscaler_ctx(NULL, false, 1, 128, NULL, NULL) == NULL, "new_upscaler_ctx(NULL)");
    uint8_t px[12] = {0};
    out = (sd_image_t*)0x1;
    n = 42;
    CHECK(!upscale(NULL, (sd_image_t){2, 2, 3, px}, 4, &out, &n), "upscale(NULL ctx)");
    CHECK(out == NULL && n == 0, "upscale clears its outputs on failure");
    CHECK(!upscale(NULL, (sd_image_t){2, 2, 3, NULL}, 4, NULL, NULL), "upscale(NULL...)");
    CHECK(get_upscale_factor(NULL) == 1, "get_upscale_factor(NULL)");
    free_upscaler_ctx(NULL);

    // adetailer
    CHECK(new_adetailer_ctx(tmp_path("no-such-detector.safetensors"), 1, NULL, NULL) == NULL,
          "new_adetailer_ctx(missing)");
    CHECK(new_adetailer_ctx(NULL, 1, NULL, NULL) == NULL, "new_adetailer_ctx(NULL)");
    sd_adetailer_params_t ap = {"face", NULL, NULL};
    out = (sd_image_t*)0x1;
    n = 42;
    CHECK(!adetail_image(NULL, NULL, (sd_image_t){2, 2, 3, px}, &ap, &ip, &out, &n), "adetail_image(NULL)");
    CHECK(out == NULL && n == 0, "adetail_image clears its outputs on failure");
    CHECK(!adetail_image(NULL, NULL, (sd_image_t){0, 0, 0, NULL}, NULL, NULL, NULL, NULL), "adetail_image(NULL...)");
    free_adetailer_ctx(NULL);

    // conversion
    CHECK(!convert(tmp_path("no-such-model.safetensors"), NULL, tmp_path("out.gguf"), SD_TYPE_F16, NULL, false),
          "convert(missing)");
    CHECK(!exists(tmp_path("out.gguf")), "a failed convert leaves no output file");
    CHECK(!convert(tmp_path("junk.safetensors"), NULL, tmp_path("out.gguf"), SD_TYPE_Q8_0, NULL, false), "convert(junk)");
    CHECK(!exists(tmp_path("out.gguf")), "a failed convert leaves no output file");
    CHECK(!convert(NULL, NULL, NULL, SD_TYPE_F16, NULL, false), "convert(NULL)");
    CHECK(!convert(tmp_path("junk.safetensors"), NULL, tmp_path("out.gguf"), (enum sd_type_t)9999, "??", true),
          "convert(bad type)");
    CHECK(!convert_with_components(NULL, NULL, NULL, NULL, NULL, NULL, tmp_path("out2.gguf"), SD_TYPE_F16, NULL,
                                   false, 1),
          "convert_with_components(no inputs)");
    CHECK(!convert_with_components(tmp_path("no-such-model.safetensors"), NULL, NULL, NULL, NULL, NULL,
                                   tmp_path("out2.gguf"), SD_TYPE_F16, NULL, false, 1),
          "convert_with_components(missing)");
    CHECK(!exists(tmp_path("out2.gguf")), "a failed convert_with_components leaves no output file");
}

static void cleanup_tmpdir(void) {
    const char* names[] = {"in.dat", "out.dat", "empty.dat", "trunc.dat", "huge.dat", "neg.dat",
                           "junk.safetensors", "hdr.safetensors", "out.gguf", "out2.gguf"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) unlink(tmp_path(names[i]));
    if (rmdir(tmpdir) != 0) fprintf(stderr, "note: could not remove %s: %s\n", tmpdir, strerror(errno));
}

int main(void) {
    alarm(900);  // never hang a CI run
    snprintf(tmpdir, sizeof(tmpdir), "%s/sd-api-test.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 2;
    }
    sd_set_log_callback(on_log, &log_count);

    test_facts();
    test_list_devices();
    test_names();
    test_params();
    test_callbacks();
    test_free_images();
    test_canny();
    test_imatrix();
    test_failures();
    CHECK(log_count > 0, "the log callback received no message");

    sd_set_log_callback(NULL, NULL);
    cleanup_tmpdir();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
