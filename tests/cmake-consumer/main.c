// Smallest useful consumer: library facts and devices through the public header.
#include <stable-diffusion.h>
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    const char* version = sd_version();
    if (!version || !*version) return 1;
    size_t need = sd_list_devices(NULL, 0);
    char* devices = malloc(need + 1);
    if (!devices || sd_list_devices(devices, need + 1) != need) return 1;
    sd_ctx_params_t params;
    sd_ctx_params_init(&params);
    char* text = sd_ctx_params_to_str(&params);
    printf("stable-diffusion %s (%s), %d cores\n%s", version, sd_commit(), sd_get_num_physical_cores(), devices);
    int ok = text != NULL;
    free(text);
    free(devices);
    return ok ? 0 : 1;
}
