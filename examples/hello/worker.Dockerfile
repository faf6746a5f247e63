# This Dockerfile lives outside the worker context (worker/): Kiln hashes its contents into the
# image address, so editing it changes the tag just as editing a file in the context does.
FROM scratch
ARG GREETING=hello
ENV GREETING=${GREETING}
COPY greeting.txt /greeting.txt
